"""adapters/per_variables.PerVariables: one object per set of live variables; a new variable that
reuses a dead one's id() never gets the dead one's object (the horovod TF tape and the Keras
optimizer keyed their reducers by id() alone, and ranks whose allocators reused an id differently
ran different collectives: 'peer rank 1 sent all_reduce while this rank expected all_gather')."""

import gc

from nccl_ddp.adapters.per_variables import PerVariables


class Var:  # stands for a tf.Variable / keras.Variable (weakly referenceable)
    pass


class Slotted:  # no __weakref__: cannot be weakly referenced
    __slots__ = ("x",)


def test_same_variables_same_object_new_variables_new_object():
    cache, built = PerVariables(), []

    def build():
        built.append(object())
        return built[-1]

    a, b = Var(), Var()
    first = cache.get([a, b], "mean", build)
    assert cache.get([a, b], "mean", build) is first
    assert cache.get([a, b], "sum", build) is not first  # other settings, other object
    assert cache.get([b, a], "mean", build) is not first  # order matters (bucket layout)
    assert len(built) == 3


def test_a_dead_variables_id_reused_by_a_new_one_gets_a_new_object():
    cache = PerVariables()
    seen = {}
    for step in range(50):  # CPython hands a freed object's address to the next one of its size
        v = Var()
        made = cache.get([v], None, lambda: step)
        assert made == step, f"step {step}: got the object built at step {made} for a dead variable"
        seen.setdefault(id(v), []).append(step)
        del v  # freed here, by its reference count (a gc.collect per step took 30 s in the full run)
    assert any(len(steps) > 1 for steps in seen.values()), "no id was reused: the test proved nothing"
    assert len(cache) == 0  # every entry went with its variable


def test_variables_without_weak_references_are_kept_alive_by_their_entry():
    cache = PerVariables()
    s = Slotted()
    ident = id(s)
    made = cache.get([s], None, lambda: "reducer")
    del s
    gc.collect()
    assert cache.get([Slotted()], None, lambda: "other") == "other"  # the pinned one keeps its id
    assert len(cache) == 2 and made == "reducer" and ident in {k[0][0] for k in cache._entries}
