"""NumPy arrays across the boundary: ``(name, dtype, shape, bytes)`` tuples,
little-endian and C-ordered, which the extension reads into cohort's tree."""

import numpy as np

# The dtypes a cohort tree holds, by NumPy's names. float64 is narrowed to
# float32: models travel in PyTorch's default float, as cohort's files do.
_DTYPES = ("float32", "float16", "int64", "int32", "uint8", "bool")


def to_wire(name, array):
    a = np.asarray(array)
    if a.dtype == np.float64:
        a = a.astype(np.float32)
    if a.dtype.name not in _DTYPES:
        raise TypeError(
            f"tensor {name!r}: dtype {a.dtype} is not one of {', '.join(_DTYPES)} (or float64)"
        )
    a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    return (str(name), a.dtype.name, list(a.shape), a.tobytes())


def from_wire(dtype, shape, data):
    if dtype == "bfloat16":
        # NumPy has no bfloat16: its bits are a float32's upper half.
        flat = (np.frombuffer(data, dtype="<u2").astype("<u4") << 16).view("<f4")
    else:
        flat = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"))
    # A copy: frombuffer over bytes is read-only, and models get trained.
    return flat.reshape(shape).astype(flat.dtype.newbyteorder("="), copy=True)


def dict_to_wire(model):
    return [to_wire(name, array) for name, array in model.items()]


def dict_from_wire(tensors):
    return {name: from_wire(dtype, shape, data) for name, dtype, shape, data in tensors}


def params_to_wire(params):
    """A model as a dict of named arrays, or as a Flower-style list of arrays
    (named by position); the second value restores the caller's form."""
    if isinstance(params, dict):
        return dict_to_wire(params), dict_from_wire
    arrays = list(params)
    return [to_wire(str(i), a) for i, a in enumerate(arrays)], _list_from_wire


def _list_from_wire(tensors):
    named = dict_from_wire(tensors)
    return [named[str(i)] for i in range(len(named))]
