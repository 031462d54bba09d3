"""Text data -> tokens -> packed training batches.

Text comes in through Hugging Face `datasets` (plain-text, JSON-lines, Parquet or Arrow files, one file or a
folder of them). Documents are tokenized by batched `datasets.map` in several processes and written, each
followed by the end-of-document token, as one uint32 token file in a cache folder (`token_store`); training
reads it memory-mapped, so a corpus larger than memory works and every process on the machine shares one copy.
The stream is cut into samples of seq_len + 1 tokens (consecutive samples share one token: the last label of
one is the first input of the next); each epoch visits every sample once in an order drawn from (seed,
epoch), and step t's global batch is positions t x batch .. (t + 1) x batch - 1 of that sequence of epochs,
so the sample order is a pure function of (seed, step) and a resumed run sees what an uninterrupted run
would have.
"""
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from pith_apps.config import ConfigError, read_json, require

DEFAULT_CORPUS = Path(__file__).parent / "corpus" / "tiny_stories.txt"
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
KINDS = ".txt/.jsonl/.json/.parquet/.arrow"
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 and one end-of-document token (256): needs no download."""
    vocab_size = 257
    eos_id = 256

    fingerprint = "utf-8 bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer.json, run by the `tokenizers` library. The end-of-document token is the
    eos_token of a tokenizer_config.json beside it, else the first of END_TOKENS in its vocabulary."""
    END_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"--tokenizer '{path}': no such file; give a tokenizer.json or a folder holding one")
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as err:   # tokenizers raises a bare Exception for a file it cannot parse
            raise ConfigError(f"--tokenizer '{file}' is not a tokenizer.json the tokenizers library reads: "
                              f"{str(err).strip()[:200]}") from None
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.fingerprint = hashlib.sha256(file.read_bytes()).hexdigest()
        self.eos_id = self.tokenizer.token_to_id(self.end_token(file))

    def end_token(self, file: Path) -> str:
        config = file.with_name("tokenizer_config.json")
        eos = read_json(config).get("eos_token") if config.is_file() else None
        if eos:
            eos = eos["content"] if isinstance(eos, dict) else eos   # transformers writes either form
            require(self.tokenizer.token_to_id(eos) is not None, f"--tokenizer '{file}': the eos_token {eos!r} that "
                    f"{config.name} beside it names is not in its vocabulary")
            return eos
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        token = next((token for token in self.END_TOKENS if token in vocab), None)
        require(token is not None, f"--tokenizer '{file}': cannot tell its end-of-document token; none of "
                f"{', '.join(self.END_TOKENS)} is in its vocabulary and no tokenizer_config.json beside it names an "
                "eos_token")
        return token

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint32) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


SAVED_DATASET_FILES = ("dataset_info.json", "state.json")   # beside the .arrow files of datasets' save_to_disk


def data_files(path: str | Path) -> tuple[str, list[str]]:
    """The `datasets` builder name and the files for a file or folder path; ("hub", [name]) for a name of the
    Hugging Face hub (owner/name) that is no local path."""
    name, path = str(path), Path(path)
    if not path.exists():
        if HUB_NAME.fullmatch(name) and path.suffix not in BUILDERS:
            return "hub", [name]
        raise ConfigError(f"dataset path '{path}' does not exist; give a {KINDS} file, a folder of them or a Hugging "
                          "Face hub dataset name (owner/name)")
    files = sorted(p for p in path.iterdir() if p.suffix in BUILDERS and p.name not in SAVED_DATASET_FILES) \
        if path.is_dir() else [path]
    kinds = {BUILDERS.get(p.suffix) for p in files}
    if not files or None in kinds or len(kinds) > 1:
        raise ConfigError(f"dataset path '{path}' must be one {KINDS} file or a folder of files of one of those "
                          f"kinds; found {[p.name for p in files][:5] or 'no such files'}")
    return kinds.pop(), [str(p) for p in files]


def token_store(path: str | Path, tokenizer, text_field: str = "text", cache: str | Path = "tokens",
                workers: int = 1, log=print) -> np.ndarray:
    """All documents of the dataset as one memory-mapped uint32 stream, each followed by the end token. A
    document is the text_field of a row (a .txt file's field is its lines, 'text'). Built once per (files
    with their sizes and times, tokenizer, field) into a folder of `cache`, under a file lock, so that the
    processes of a run, or several runs, wait for one build and share it."""
    builder, files = data_files(path)
    if builder != "hub" and all(Path(file).stat().st_size == 0 for file in files):
        raise ConfigError(f"dataset '{path}' holds no text (its files are empty)")
    field = "text" if builder == "text" else text_field
    identity = files if builder == "hub" else [[str(Path(f).resolve()), Path(f).stat().st_size, Path(f).stat().st_mtime_ns]
                                              for f in files]   # a hub dataset is kept until its folder is deleted
    key = hashlib.sha256(json.dumps([identity, tokenizer.fingerprint, tokenizer.eos_id, field]).encode()).hexdigest()
    folder = Path(cache) / key[:24]
    tokens = folder / "tokens.u32"
    try:
        with locked(folder):
            if not tokens.is_file():
                build_store(path, builder, files, field, tokenizer, folder, workers, log)
    except OSError as err:
        raise ConfigError(f"--data-cache {cache}: could not write the tokenized dataset there "
                          f"({err.strerror or err}); choose another --data-cache") from None
    count = json.loads((folder / "meta.json").read_text())["tokens"]
    if count == 0:
        raise ConfigError(f"dataset '{path}' holds no text")
    return np.memmap(tokens, dtype=np.uint32, mode="r", shape=(count,))


@contextmanager
def locked(folder: Path):
    """Held while the store in folder is looked for and built: the processes that want it wait for one build. On a
    file system without flock (some shared ones, as RunFolder.lock meets them) the build goes on unlocked, with a
    warning: only a build is at risk, the store being read-only once built."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_suffix(".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes, also when the process dies
        except OSError as err:
            warnings.warn(f"--data-cache {folder.parent} takes no file lock ({err.strerror}): processes that find this "
                          "dataset untokenized at once (a run's ranks, runs started together) would each build it in "
                          "the same folder and could spoil it; let one process tokenize it first, or give a "
                          "--data-cache on a file system with locks")
        yield


def build_store(path, builder: str, files: list[str], field: str, tokenizer, folder: Path, workers: int, log):
    scratch = folder.with_name(folder.name + ".building")
    shutil.rmtree(scratch, ignore_errors=True)   # a build that died
    try:
        tokenize_into(scratch, path, builder, files, field, tokenizer, workers, log)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(scratch, folder)   # whole or not at all
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def tokenize_into(scratch: Path, path, builder: str, files: list[str], field: str, tokenizer, workers: int, log):
    import datasets  # heavy import: only when data is actually tokenized

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)   # its reading errors reach the user as our one line
    tic = time.perf_counter()
    try:
        if builder == "hub":
            dataset = datasets.load_dataset(files[0], split="train", cache_dir=str(scratch / "hf"))
        else:
            dataset = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=str(scratch / "hf"))
    except Exception as err:   # datasets wraps every reading problem in its own exception types
        if builder == "hub":
            raise ConfigError(f"dataset '{path}' is no local file or folder, and the Hugging Face hub did not give it: "
                              f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}") from None
        raise ConfigError(f"dataset '{path}' could not be read: {first_bad_line(builder, files) or root_cause(err)}") from None
    if field not in dataset.column_names:
        raise ConfigError(f"dataset '{path}' has columns {dataset.column_names}, no '{field}'; name the column to "
                          "train on with --text-field")
    require_strings(dataset, field, path)
    processes = max(1, min(workers, len(dataset) // 1000))   # a process per 1000 documents at least
    log(f"tokenizing {len(dataset):,} documents of {path} in {processes} process(es) into {scratch.parent}")
    ids = dataset.map(encode_rows, batched=True, batch_size=1000, num_proc=processes if processes > 1 else None,
                      remove_columns=dataset.column_names, fn_kwargs=dict(tokenizer=tokenizer, field=field),
                      cache_file_name=str(scratch / "ids.arrow"))
    if "ids" not in ids.column_names:   # every batch's texts empty: the map made no column
        raise ConfigError(f"dataset '{path}' holds no text (every '{field}' is empty)")
    count = 0
    with open(scratch / "tokens.u32", "wb") as out:   # chunk by chunk: the token array is never in memory whole
        for chunk in ids.data.column("ids").chunks:
            values = chunk.flatten().to_numpy().astype(np.uint32, copy=False)
            values.tofile(out)
            count += values.size
        out.flush()
        os.fsync(out.fileno())
    (scratch / "meta.json").write_text(json.dumps(dict(tokens=count, documents=len(ids), source=str(path))))
    rows, skipped = len(dataset), len(dataset) - len(ids)   # encode_rows leaves out rows without text
    del dataset, ids   # their memory-mapped files go with the scratch folder's copies of the data
    shutil.rmtree(scratch / "hf")
    for leftover in scratch.glob("ids*.arrow"):
        leftover.unlink()
    log(f"tokenized: {count:,} tokens in {time.perf_counter() - tic:.1f} s" +
        (f"; {skipped:,} of the {rows:,} rows had no text in '{field}' and were left out" if skipped else ""))


def encode_rows(rows: dict, tokenizer, field: str) -> dict:
    texts = [text for text in rows[field] if text]
    eos = np.array([tokenizer.eos_id], dtype=np.uint32)
    return {"ids": [np.concatenate([ids.astype(np.uint32), eos]) for ids in tokenizer.encode_batch(texts)]}


def require_strings(dataset, field: str, path):
    """Every row's field a string (or empty): read through only when the column's type is not string."""
    if getattr(dataset.features[field], "dtype", None) in ("string", "large_string"):
        return
    for row, text in enumerate(dataset[field]):
        if text is not None and not isinstance(text, str):
            raise ConfigError(f"dataset '{path}' has a '{field}' of type {type(text).__name__} in row {row + 1}; "
                              f"every '{field}' must be a string")


def first_bad_line(builder: str, files: list[str]) -> str | None:
    """The first line of the files that is not UTF-8 (or, for JSON lines, not a JSON object), as 'file line N:
    why'; None when every line reads, or for binary (Parquet, Arrow) files."""
    for file in files if builder in ("text", "json") else []:
        with open(file, "rb") as f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                    if builder == "json" and line.strip():
                        json.loads(line)
                except ValueError as err:   # UnicodeDecodeError and JSONDecodeError are ValueErrors
                    return f"{Path(file).name} line {number}: {err}"
    return None


def root_cause(err: BaseException) -> str:
    while err.__cause__ or err.__context__:
        err = err.__cause__ or err.__context__
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"


@functools.lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, samples: int) -> np.ndarray:
    return torch.randperm(samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).numpy()


def batch_at(tokens, step: int, seed: int, batch_size: int, seq_len: int):
    """(input_ids, labels), each [batch_size, seq_len] int64: step's global batch of the epoch-ordered samples.
    The last (len(tokens) - 1) % seq_len tokens of the stream fall in no sample."""
    samples = (len(tokens) - 1) // seq_len
    if samples < 1:
        raise ConfigError(f"dataset has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    rows = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, index = divmod(position, samples)
        start = int(epoch_order(seed, epoch, samples)[index]) * seq_len
        rows.append(np.asarray(tokens[start:start + seq_len + 1], dtype=np.int64))
    windows = torch.from_numpy(np.stack(rows))
    return windows[:, :-1], windows[:, 1:]


def split_held_out(tokens, batches: int, batch_size: int, seq_len: int):
    """(training tokens, held-out tokens): the stream's last `batches` global batches of samples are held out
    (none for 0); training never reads them."""
    held = batches * batch_size * seq_len + 1 if batches else 0
    require(len(tokens) >= seq_len + 1, f"the dataset's {len(tokens):,} tokens hold no sample of --seq-len {seq_len} "
            "(+ 1 for its last label); lower --seq-len or use more data")
    require(len(tokens) - held >= seq_len + 1, f"the dataset's {len(tokens):,} tokens cannot hold out --eval-batches "
            f"{batches} of {batch_size} x {seq_len} tokens and still train; lower --eval-batches or use more data")
    return tokens[:len(tokens) - held], tokens[len(tokens) - held:]


def held_out_batch(tokens, index: int, batch_size: int, seq_len: int):
    """(input_ids, labels) of held-out batch `index`: its samples in stream order."""
    first = index * batch_size
    windows = np.stack([np.asarray(tokens[(first + row) * seq_len:(first + row + 1) * seq_len + 1], dtype=np.int64)
                        for row in range(batch_size)])
    return torch.from_numpy(windows[:, :-1]), torch.from_numpy(windows[:, 1:])


def document_ids(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[batch, seq]: the index of each token's document within its sequence; a document ends with its end token,
    so the token after one starts the next document."""
    ends = (input_ids == eos_id).long()
    return ends.cumsum(1) - ends
