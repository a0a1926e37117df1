"""The resume check several test modules share: a whole pass, against the
same pass cut after some batches, its state saved (through pickle) and
restored into a fresh loader built with another seed (the state's wins)."""
import gc
import pickle


def whole_and_resumed(make, cut: int) -> tuple[list, list]:
    """``(whole, resumed)``: the batches of ``make(seed=None)``'s pass, and
    those of the pass cut after ``cut`` batches then finished by
    ``make(seed=99)`` restored from its state."""
    whole = list(make())
    a = make()
    it = iter(a)
    got = [next(it) for _ in range(cut)]
    state = pickle.loads(pickle.dumps(a.state_dict()))
    del it, a
    gc.collect()
    b = make(seed=99)
    b.load_state_dict(state)
    return whole, got + list(b)
