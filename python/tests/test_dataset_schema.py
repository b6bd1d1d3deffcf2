"""ferry.datasets' keywords against the C++ schema that declares each option once
(ferry/loaders/registry.h, DatasetSchema): every keyword default is the schema's, every schema key
is reachable from Python, and a bad value's error names the option and its range."""

import inspect

import pytest

import ferry
import ferry.datasets as fd
from ferry import _ferry

# Each function, the dataset(s) it makes, and its keywords whose schema key has another name.
FUNCTIONS = [
    (fd.image_folder, ["image_folder"], {}),
    (fd.idx, ["idx"], {}),
    (fd.npy, ["npy"], {}),
    (fd.tar, ["tar", "tar_index"], {}),
    (fd.tokens, ["tokens"], {"vocab_size": "vocab"}),
    (fd.megatron, ["megatron"], {"vocab_size": "vocab"}),
    (fd.synthetic, ["synthetic"], {}),
]
PYTHON_ONLY = {"timeout", "index"}  # the reads' deadline; tar's choice between two datasets
# Schema keys no keyword sets: raw windows are the loader's own route to the GPU's widening
# (DataLoader(device=...) asks for them through raw_token_windows).
NOT_KEYWORDS = {"raw"}
# Keywords whose None means "not passed": the schema's default applies, or another keyword implies
# the option (float: mean= or std= imply it).
NONE_IS_THE_SCHEMAS = {"float"}


def as_schema_text(value):
    """A Python default as the schema writes it."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return "x".join(str(v) for v in value)
    if isinstance(value, float) and value == int(value):
        return str(int(value))
    return str(value)


@pytest.mark.parametrize("fn,names,renamed", FUNCTIONS, ids=[f[0].__name__ for f in FUNCTIONS])
def test_keyword_defaults_are_the_schemas(fn, names, renamed):
    params = {renamed.get(k, k): p for k, p in inspect.signature(fn).parameters.items() if k not in PYTHON_ONLY}
    schemas = {name: {o["key"]: o for o in _ferry.dataset_schema(name)} for name in names}
    keys = set().union(*schemas.values()) - NOT_KEYWORDS
    # Every keyword is an option of the dataset, and every option a keyword.
    assert set(params) <= keys, set(params) - keys
    assert keys <= set(params), keys - set(params)
    for key, p in params.items():
        declared = [s[key] for s in schemas.values() if key in s]
        for o in declared:
            if o["default"] is None:
                # No default in the schema: the keyword is required (a path) or None (not passed).
                assert p.default is inspect.Parameter.empty or p.default is None, (key, p.default)
            elif p.default is None:
                assert key in NONE_IS_THE_SCHEMAS, (key, o["default"])
            else:
                assert as_schema_text(p.default) == o["default"], (key, p.default, o["default"])


def test_a_bad_value_names_the_option_and_its_range():
    with pytest.raises(ferry.Error, match=r"dataset 'synthetic': option 'throw_rate' must be a number in \[0, 1\], got '2"):
        fd.synthetic(throw_rate=2)
    with pytest.raises(ferry.Error, match=r"option 'n' must be an integer >= 0, got '-1'"):
        fd.synthetic(n=-1)
    with pytest.raises(ferry.Error, match=r"option 'dtype' must be one of bool, uint8, .*, got 'complex'"):
        fd.synthetic(dtype="complex")
    with pytest.raises(ferry.Error, match=r"unknown option 'colour' \(it takes: n, shape, dtype"):
        fd.registry("synthetic", colour="red")


def test_help_lists_each_option_with_its_default():
    text = _ferry.help("megatron")
    for o in _ferry.dataset_schema("megatron"):
        assert f"\n  {o['key']}={o['default'] or ''} " in text
    with pytest.raises(KeyError, match="no schema for dataset 'nosuch'"):
        _ferry.dataset_schema("nosuch")
