"""Text data -> tokens -> packed training batches.

Text comes in through Hugging Face `datasets` (plain-text, JSON-lines, Parquet or Arrow files, one file or a
folder of them). Documents are tokenized, joined with an end-of-document token into one stream, and each batch
is a set of windows of that stream at offsets drawn from (seed, step): the sample order is a pure
function of them, so a resumed run sees exactly the batches an uninterrupted run would have.
"""
import json
from pathlib import Path

import torch

from pith_apps.config import ConfigError

DEFAULT_CORPUS = Path(__file__).parent / "corpus" / "tiny_stories.txt"
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
KINDS = ".txt/.jsonl/.json/.parquet/.arrow"


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 and one end-of-document token (256): needs no download."""
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

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
        self.eos_id = self.tokenizer.token_to_id(self.end_token(file) or "")
        if self.eos_id is None:
            raise ConfigError(f"--tokenizer '{file}': cannot tell its end-of-document token; none of "
                              f"{', '.join(self.END_TOKENS)} is in its vocabulary and no tokenizer_config.json beside "
                              "it names an eos_token")

    def end_token(self, file: Path) -> str | None:
        config = file.with_name("tokenizer_config.json")
        eos = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
        if eos:
            return eos["content"] if isinstance(eos, dict) else eos   # transformers writes either form
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        return next((token for token in self.END_TOKENS if token in vocab), None)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


def data_files(path: str | Path) -> tuple[str, list[str]]:
    """The `datasets` builder name and the files for a file or folder path."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"dataset path '{path}' does not exist; give a {KINDS} file or a folder of them")
    files = sorted(p for p in path.iterdir() if p.suffix in BUILDERS) if path.is_dir() else [path]
    kinds = {BUILDERS.get(p.suffix) for p in files}
    if not files or None in kinds or len(kinds) > 1:
        raise ConfigError(f"dataset path '{path}' must be one {KINDS} file or a folder of files of one of those "
                          f"kinds; found {[p.name for p in files][:5] or 'no such files'}")
    return kinds.pop(), [str(p) for p in files]


def load_token_stream(path: str | Path, tokenizer, text_field: str = "text") -> torch.Tensor:
    """All documents of the dataset as one int64 stream, documents separated by the eos token. A document is
    the text_field of a row (a .txt file's field is its lines, 'text')."""
    import datasets  # heavy import: only when data is actually loaded

    builder, files = data_files(path)
    if all(Path(file).stat().st_size == 0 for file in files):
        raise ConfigError(f"dataset '{path}' holds no text (its files are empty)")
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)   # its reading errors reach the user as our one line
    try:
        dataset = datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as err:   # datasets wraps every reading problem in its own exception types
        raise ConfigError(f"dataset '{path}' could not be read: {first_bad_line(builder, files) or root_cause(err)}") from None
    field = "text" if builder == "text" else text_field
    if field not in dataset.column_names:
        raise ConfigError(f"dataset '{path}' has columns {dataset.column_names}, no '{field}'; name the column to "
                          "train on with --text-field")
    stream = []
    for row, text in enumerate(dataset[field]):
        if text is not None and not isinstance(text, str):
            raise ConfigError(f"dataset '{path}' has a '{field}' of type {type(text).__name__} in row {row + 1}; "
                              f"every '{field}' must be a string")
        if text:
            stream.extend(tokenizer.encode(text))
            stream.append(tokenizer.eos_id)
    if not stream:
        raise ConfigError(f"dataset '{path}' holds no text")
    return torch.tensor(stream, dtype=torch.int64)


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


def batch_at(stream: torch.Tensor, step: int, seed: int, batch_size: int, seq_len: int):
    """(input_ids, labels), each [batch_size, seq_len]: windows of the stream chosen by (seed, step)."""
    if stream.numel() <= seq_len + 1:
        raise ConfigError(f"dataset has {stream.numel()} tokens, fewer than seq_len + 2 = {seq_len + 2}")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]
