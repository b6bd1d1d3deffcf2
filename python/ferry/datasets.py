"""ferry's datasets: each one read, decoded and transformed by ferry's C++ threads.

Every path may be an object in S3-compatible storage: ``image_folder("s3://bucket/train/")``,
``tar(shards=["s3://bucket/train-{000..127}.tar"])`` (brace ranges as WebDataset writes them),
``tar(dir="s3://bucket/shards/")``, ``npy("s3://bucket/x.npy")``, ``idx(...)``. The endpoint,
region and credentials come from AWS's usual variables and files (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_PROFILE, ~/.aws/credentials, ...: the C++ header
ferry/loaders/storage.h lists them); ``ferry.object_store_stats()`` counts requests, bytes,
retries, hedges and on-disk cache hits (FERRY_S3_CACHE_DIR keeps what was read on local disk).

``timeout`` (seconds; every dataset here takes it): a deadline for the object-store reads made
while the dataset is built (an .npy's or IDX file's header, an image folder's listing, an indexed
tar's headers, a token file's index), as DataLoader(timeout=) bounds a loader's reads: past it,
ferry.TimeoutError names the URL. None (the default) waits through every retry of a silent
server (AWS_MAX_ATTEMPTS x FERRY_S3_STALL_SECONDS). A read that fails for good is the same
error as in a loader: ferry.DataError naming the URL, or ferry.IoError (a DataError) once its
retries are spent.

Every dataset yields samples as a tuple of fields; the loader stacks them into batches
(image datasets: ``(images, labels)``, labels as int64).
"""

from __future__ import annotations

import builtins
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import _ferry
from ._ferry import Dataset

__all__ = ["Dataset", "image_folder", "idx", "npy", "tar", "tokens", "megatron", "parquet", "mixture", "synthetic",
           "registry", "load_plugin", "registered"]

Floats = Union[float, Sequence[float]]


def _defaults(name: str) -> Dict[str, Any]:
    """Dataset ``name``'s option defaults as Python values, read from its C++ schema (the one place
    each is declared: ferry/loaders/registry.h, DatasetSchema); options without one are left out."""
    out: Dict[str, Any] = {}
    for o in _ferry.dataset_schema(name):
        text = o["default"]
        if text is None:
            continue
        kind = o["kind"]
        if kind == "flag":
            out[o["key"]] = text == "1"
        elif kind == "int" or (kind == "choice" and all(c.isdigit() for c in o["choices"])):
            out[o["key"]] = int(text)
        elif kind == "number":
            out[o["key"]] = builtins.float(text)
        else:
            out[o["key"]] = text
    return out


_IMAGE_FOLDER = _defaults("image_folder")
_IDX = _defaults("idx")
_TAR = _defaults("tar")
_TOKENS = _defaults("tokens")
_MEGATRON = _defaults("megatron")
_PARQUET = _defaults("parquet")
_SYNTHETIC = _defaults("synthetic")
_SYNTHETIC_SHAPE = tuple(int(x) for x in _SYNTHETIC["shape"].split("x"))


def _items(value) -> List[str]:
    """A value as the registry's typed options take it (DatasetConfig::Values): its items as
    they are, one for a scalar; a path is a path, whatever characters it holds."""
    if isinstance(value, bool):
        return ["1" if value else "0"]
    if isinstance(value, (list, tuple)):
        return [item for v in value for item in _items(v)]
    return [str(value)]


def _config(**options) -> Dict[str, List[str]]:
    return {k: _items(v) for k, v in options.items() if v is not None}


def _make(name: str, timeout: Optional[float], **options) -> Dataset:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, builtins.float))
                                or not timeout > 0):
        raise ValueError(f"{name}: timeout={timeout!r} is not a number of seconds > 0 (None: no deadline)")
    return _ferry.make_dataset(name, _config(**options), None if timeout is None else builtins.float(timeout))


def registry(name: str, timeout: Optional[float] = None, **options) -> Dataset:
    """Any dataset the registry knows (the built-in ones, and those a plugin registered), configured
    with its keys: ``ferry.datasets.registry("ramp", n=1000, dim=16)``. ferry.Error names an
    unknown dataset or key. ``timeout``: as every dataset's here (see the module's help)."""
    return _make(name, timeout, **options)


def image_folder(root: str, size: int = _IMAGE_FOLDER["size"], random_crop: bool = _IMAGE_FOLDER["random_crop"],
                 channels: int = _IMAGE_FOLDER["channels"], float: Optional[bool] = None, mean: Optional[Floats] = None,
                 std: Optional[Floats] = None, dct_scaling: bool = _IMAGE_FOLDER["dct_scaling"],
                 decode: str = _IMAGE_FOLDER["decode"], timeout: Optional[float] = None) -> Dataset:
    """JPEG/PNG images in ``root/<class>/<image>``, labels by class folder (sorted), as
    ``(image, label)``: uint8 HWC as decoded, or float32 CHW with ``float=True`` or mean/std
    (normalize, per channel: one value or one per channel).

    random_crop: RandomResizedCrop(size) + horizontal flip, keyed by (seed, epoch, index); else
    resize of the shorter side + center crop. decode="gpu" decodes JPEGs with nvJPEG on the
    loader's device (DataLoader(device=...)), with the same crops as the CPU path."""
    if decode not in ("cpu", "gpu"):
        raise ValueError(f"image_folder: decode must be 'cpu' or 'gpu', got {decode!r}")
    return _make("image_folder", timeout,
                 root=root, size=size, channels=channels, random_crop=random_crop, float=float, mean=mean, std=std,
                 dct_scaling=dct_scaling, decode=decode)


def idx(images: str, labels: str, flip: bool = _IDX["flip"], float: Optional[bool] = None,
        mean: Optional[float] = None, std: Optional[float] = None, timeout: Optional[float] = None) -> Dataset:
    """IDX images and labels (the MNIST / Fashion-MNIST format, raw or .gz) as ``(image, label)``:
    uint8 28x28 images as the file stores them (batches ``[B, 28, 28]``), or float32 1x28x28 with
    ``float=True`` or mean/std (batches ``[B, 1, 28, 28]``, as torchvision's ToTensor gives);
    flip: random horizontal flip.
    With DataLoader(device=...) the GPU gathers each batch's images and labels itself, the flip and
    normalize included, with no worker (gather="host" has workers do it); the batches are the same."""
    return _make("idx", timeout, images=images, labels=labels, flip=flip, float=float, mean=mean, std=std)


def npy(path: str, timeout: Optional[float] = None) -> Dataset:
    """The rows of a .npy array (memory-mapped) as ``(row,)``. With DataLoader(device=...,
    gather="device") the GPU gathers each batch's rows straight from the registered mapping;
    gather="auto" leaves a mapped file to the workers (see ferry/pinning/gather.h)."""
    return _make("npy", timeout, path=path)


def tar(dir: Optional[str] = None, shards: Optional[Iterable[str]] = None, size: int = _TAR["size"],
        random_crop: bool = _TAR["random_crop"], channels: int = _TAR["channels"], shuffle: bool = _TAR["shuffle"],
        index: Optional[bool] = None, float: Optional[bool] = None, mean: Optional[Floats] = None,
        std: Optional[Floats] = None, dct_scaling: bool = _TAR["dct_scaling"], decode: str = _TAR["decode"],
        timeout: Optional[float] = None) -> Dataset:
    """WebDataset-style tar shards (``<key>.jpg`` + ``<key>.cls``) as ``(image, label)``: ``dir``
    (its .tar files) or a list of ``shards``.

    By default a stream, read front to back: it has no len() and takes no DataLoader(shuffle=...);
    ``shuffle`` here shuffles the shard order each epoch. The stream's shards are read once, on
    reader threads of their own, and its records are put in batches in one order (shard after
    shard), each batch made by whichever worker is free: every worker decodes whatever the number
    of shards, every batch is full but the epoch's last, and the batches are the same for any
    ``num_workers`` (and on resume at another).
    ``float``, ``mean``, ``std`` and ``dct_scaling`` are image_folder's. ``index=True`` (the default
    with ``decode="gpu"``) reads every member's header and every label once and makes a map-style
    dataset instead (C++ ``TarImages``): len(), DataLoader(shuffle=True) across all shards and GPU
    decode by batch. It reads records at random offsets: on storage that wants files read front to
    back (object stores), keep the stream; ``decode="gpu", index=False`` is the stream with each
    JPEG decoded on the device (one request for each 8 MiB of a shard instead of one for each
    record)."""
    if (dir is None) == (shards is None):
        raise ValueError("tar: pass dir= or shards=, not both")
    if decode not in ("cpu", "gpu"):
        raise ValueError(f"tar: decode must be 'cpu' or 'gpu', got {decode!r}")
    if index is None:
        index = decode == "gpu"
    shard_list: Optional[List[str]] = None if shards is None else list(shards)
    if index:
        if not shuffle:
            raise ValueError("tar: shuffle= is the stream's shard order; an indexed tar is shuffled by DataLoader(shuffle=...)")
        return _make("tar_index", timeout, dir=dir, shards=shard_list, size=size, random_crop=random_crop,
                     channels=channels, float=float, mean=mean, std=std, dct_scaling=dct_scaling, decode=decode)
    return _make("tar", timeout, dir=dir, shards=shard_list, size=size, random_crop=random_crop, channels=channels,
                 shuffle=shuffle, float=float, mean=mean, std=std, dct_scaling=dct_scaling, decode=decode)


def tokens(path: str, seq_len: int = _TOKENS["seq_len"], dtype: Optional[str] = None, eod: Optional[int] = None,
           packed: bool = _TOKENS["packed"], random_offset: bool = _TOKENS["random_offset"],
           num_samples: Optional[int] = None, vocab_size: Optional[int] = None, out_dtype: str = _TOKENS["out_dtype"],
           format: str = _TOKENS["format"], timeout: Optional[float] = None) -> Dataset:
    """A flat token file as language-model sequences (C++ ``ferry::TokenSequences``): nanoGPT's raw
    ``.bin`` (give ``dtype``, e.g. "uint16"), llm.c's ``.bin`` or a 1-D ``.npy`` (their dtype from the
    header), memory-mapped, or an ``s3://`` object read by ranged requests.

    Batches are dicts: ``input_ids`` and ``labels`` ``[B, seq_len]`` (int64, or int32 with
    ``out_dtype``), labels shifted by one. The file is cut into ``(tokens - 1) // seq_len`` windows,
    each token an input of exactly one window an epoch; ``DataLoader(shuffle=True)`` shuffles them,
    the same for any ``num_workers`` and on resume. ``random_offset=True``: nanoGPT's random windows
    (``num_samples`` a epoch, default as many as windows), keyed by (seed, epoch, index).
    ``eod``: the end-of-document token id; with ``packed=True`` batches also hold ``position_ids``
    (restarting at 0 at each document) and ``cu_seqlens`` ``[B, seq_len + 1]`` int32 (each sequence's
    document offsets, then seq_len, padded by repeating seq_len). ``vocab_size``: a token id at or
    past it is a ferry.DataError naming the file and offset."""
    return _make("tokens", timeout,
                 path=path, seq_len=seq_len, dtype=dtype, eod=eod, packed=packed or None,
                 random_offset=random_offset or None, num_samples=num_samples, vocab=vocab_size, out_dtype=out_dtype,
                 format=format)


def megatron(prefix: str, seq_len: int = _MEGATRON["seq_len"], packed: bool = _MEGATRON["packed"],
             random_offset: bool = _MEGATRON["random_offset"], num_samples: Optional[int] = None,
             vocab_size: Optional[int] = None, out_dtype: str = _MEGATRON["out_dtype"],
             shuffle_documents: bool = _MEGATRON["shuffle_documents"], document_block: int = _MEGATRON["document_block"],
             best_fit_group: int = _MEGATRON["best_fit_group"], timeout: Optional[float] = None) -> Dataset:
    """A Megatron-LM indexed dataset (``prefix.bin`` + ``prefix.idx``, as megatron-core's
    ``IndexedDatasetBuilder`` writes them; local or ``s3://``) as sequences, like ``tokens``: each of
    its sequences is a document, so ``packed=True`` needs no eod id. Opening reads only the index's
    header (no pass over the corpus): the first batch comes as fast at any corpus size.
    ``shuffle_documents=True``: the windows cut a stream of the documents in an order shuffled each
    epoch (within blocks of ``document_block`` documents) instead of the corpus order.
    ``best_fit_group=G`` (with ``packed=True``): best-fit packing, each group of G sequences taking
    the stream's next G * seq_len tokens and placing its documents whole where they fit (no token
    dropped, no padding; ferry/loaders/tokens.h, Note [Best-fit packing])."""
    return _make("megatron", timeout,
                 prefix=prefix, seq_len=seq_len, packed=packed or None, random_offset=random_offset or None,
                 shuffle_documents=shuffle_documents or None,
                 document_block=document_block if shuffle_documents else None, best_fit_group=best_fit_group or None,
                 num_samples=num_samples, vocab=vocab_size, out_dtype=out_dtype)


def parquet(files: Union[str, Iterable[str], None] = None, tokenizer: Optional[str] = None, text: str = _PARQUET["text"],
            seq_len: int = _PARQUET["seq_len"], bos: Union[int, str, None] = None, eos: Union[int, str, None] = None,
            shuffle: bool = _PARQUET["shuffle"], rows_per_read: int = _PARQUET["rows_per_read"],
            dir: Optional[str] = None, packed: bool = _PARQUET["packed"]) -> Dataset:
    """Parquet files of raw text, tokenized on the fly by ferry's threads and cut into
    language-model windows (C++ ``ferry::TableTokens``, ferry/loaders/table.h): ``files`` (a path,
    a list, brace patterns) or ``dir`` (its .parquet files), the ``text`` column, and
    ``tokenizer``: a ``tokenizer.json`` (BPE: GPT-2's, Llama 3's, Llama 2's layouts; ids as PyPI's
    ``tokenizers`` gives them) or a SentencePiece ``.model``. ``bos``/``eos``: a token put before or
    after each row, by its text (``"<|endoftext|>"``) or id.

    A stream: batches are dicts of ``input_ids`` and ``labels`` ``[B, seq_len]`` int64 (labels
    shifted by one). Opening reads only the files' footers. The row groups are read and tokenized
    on reader threads, as many at once as ``num_workers`` (so every worker is busy however few
    the files), and the windows are dealt in row-group order: the batches are the same for any
    ``num_workers``. ``shuffle`` shuffles the row groups each epoch and the rows within each read of
    ``rows_per_read`` rows. A row group's ids are cut into windows of ``seq_len + 1`` tokens
    overlapping by one; the fewer than ``seq_len + 1`` left at a row group's end are not used.
    ``packed``: the batches also hold the rows' boundaries, ``position_ids`` ``[B, seq_len]``
    (restarting at 0 at each row's first token and the window's) and ``cu_seqlens``
    ``[B, seq_len + 1]`` int32 (where the rows start, then ``seq_len`` repeated), as
    ``tokens(..., packed=True)`` gives them. Null rows are skipped; a file without the column, or
    text that is not UTF-8, is a ferry.DataError naming the file (and row group and row)."""
    if (dir is None) == (files is None):
        raise ValueError("parquet: pass files= or dir=, not both")
    if tokenizer is None:
        raise ValueError("parquet: tokenizer= is required (a tokenizer.json or a SentencePiece .model)")
    file_list: Optional[List[str]] = None if files is None else ([files] if isinstance(files, str) else list(files))
    return _make("parquet", None, files=file_list, dir=dir, tokenizer=tokenizer, text=text, seq_len=seq_len,
                 bos=None if bos is None else str(bos), eos=None if eos is None else str(eos), shuffle=shuffle,
                 rows_per_read=rows_per_read, packed=packed)


def mixture(sources: Sequence[Tuple[Dataset, float]], seed: int = 0, block: int = 1000, size: Optional[int] = None,
            schedule: Sequence[Tuple[int, Sequence[float]]] = ()) -> Dataset:
    """Weighted sources as one dataset (C++ ``ferry::Mixture``): ``mixture([(web, 0.7), (code, 0.3)])``.

    Which source global sample ``g = epoch * len(mixture) + index`` comes from is a function of
    (seed, g) alone: each block of ``block`` samples gives every source its weight's share (largest
    remainder), in a shuffled order; each source shuffles its own samples per its own epoch and
    starts the next when it runs out. ``size``: samples an epoch (default: the sources' total).
    ``schedule``: ``[(from_index, weights), ...]``, weights that apply from a global index on (a
    run resumed with new weights: every sample before that index is unchanged). Use
    ``DataLoader(shuffle=False)``: the order is already random; ``state_dict()`` resumes it exactly."""
    pairs = list(sources)
    if not pairs:
        raise ValueError("mixture: no sources")
    return _ferry.make_mixture([d for d, _ in pairs], [float(w) for _, w in pairs], seed, block, size,
                               [(int(i), [float(x) for x in w]) for i, w in schedule])


def synthetic(n: int = _SYNTHETIC["n"], shape: Sequence[int] = _SYNTHETIC_SHAPE,
              dtype: str = _SYNTHETIC["dtype"], throw_rate: float = _SYNTHETIC["throw_rate"],
              delay_rate: float = _SYNTHETIC["delay_rate"], delay_ms: int = _SYNTHETIC["delay_ms"],
              fault_seed: int = _SYNTHETIC["fault_seed"]) -> Dataset:
    """In-memory patterns as ``(sample, label)``: sample i's bytes are all i % 251, its label i % 10.
    throw_rate/delay_rate/delay_ms inject failures and delays (to try a pipeline's fault handling)."""
    return _make("synthetic", None,
                 n=n, shape="x".join(str(int(d)) for d in shape), dtype=dtype, throw_rate=throw_rate or None,
                 delay_rate=delay_rate or None, delay_ms=delay_ms or None, fault_seed=fault_seed or None)


def load_plugin(path: str) -> List[str]:
    """Loads a dataset plugin library (ferry/loaders/plugin_abi.h); returns the names it registered,
    for ``registry(name, ...)``."""
    return _ferry.load_plugin(path)


def registered() -> List[str]:
    """The dataset names the registry knows."""
    return _ferry.registered()
