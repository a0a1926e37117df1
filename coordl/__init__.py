"""coordl: a drop-in torch DataLoader that stops training from waiting for data."""
__version__ = "0.1.0"
