"""The token store and the sample order: tokenized once into a memory-mapped file that every process shares,
built without the corpus or its token array in memory, each epoch every sample once across any data ranks."""
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import pith_apps.data as data_module
import pith_apps.train as train_app
from pith_apps.config import ConfigError
from pith_apps.data import ByteTokenizer, batch_at, token_store
from pith_apps.train import micro_batches_of


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_each_epoch_uses_every_sample_once_across_the_data_ranks(ranks):
    """Tokens 0..N-1 as the stream, so that a row's first input names its sample. 10 samples of 8 tokens, 4
    rows a step: epochs end inside a step. The data ranks' rows of 5 steps (2 epochs) split each epoch's
    samples among them with none twice, and the inputs of an epoch are every token before the last once."""
    seq, samples, batch = 8, 10, 4
    tokens = np.arange(samples * seq + 1 + 5, dtype=np.uint32)   # 5 tokens past the last sample: in none
    args = SimpleNamespace(batch_size=batch, micro_batch_size=1)
    seen = []   # the first token of every row of the global batches, in order
    for step in range(5):
        ids, labels = batch_at(tokens, step, seed=3, batch_size=batch, seq_len=seq)
        assert torch.equal(ids[:, 1:], labels[:, :-1]) and ids.dtype == torch.int64
        read = []   # what the data ranks read of this step's global batch
        for rank in range(ranks):
            parallel = SimpleNamespace(data_rank=rank, data_ranks=ranks, cp=1)
            for rows, _ in micro_batches_of(args, parallel, ids, labels):
                read.extend(int(row[0]) for row in rows)
        seen.extend(int(row[0]) for row in ids)
        assert sorted(read) == sorted(seen[-batch:])   # the ranks split the batch: every row read, once
    for epoch in (seen[:samples], seen[samples:]):
        assert sorted(epoch) == list(range(0, samples * seq, seq))
    assert seen[:samples] != seen[samples:]   # a new order each epoch
    firsts = [int(row[0]) for step in range(5) for row in batch_at(tokens, step, 4, batch, seq)[0]]
    assert sorted(firsts[:samples]) == sorted(seen[:samples]) and firsts != seen   # another seed, another order


def write_docs(path, documents: int, size: int = 1000):
    rng = np.random.default_rng(0)
    words = np.array(["cat", "sat", "on", "the", "mat", "Ünïcödé", "🙂", "and", "then", "slept"])
    with open(path, "w") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size // 5))}) + "\n")


def test_the_store_is_built_once_shared_and_rebuilt_when_the_data_changes(tmp_path):
    data = tmp_path / "docs.jsonl"
    write_docs(data, 2500, 200)
    lines = []
    one = token_store(data, ByteTokenizer(), cache=tmp_path / "cache", workers=1, log=lines.append)
    two = token_store(data, ByteTokenizer(), cache=tmp_path / "cache", workers=2, log=lines.append)
    assert len(lines) == 2 and "in 1 process(es)" in lines[0]   # the second call read the first's file
    assert isinstance(two, np.memmap) and np.array_equal(one, two)
    rebuilt = token_store(data, ByteTokenizer(), cache=tmp_path / "other", workers=2, log=lines.append)
    assert "in 2 process(es)" in lines[2] and np.array_equal(rebuilt, one)   # two processes, same tokens
    docs = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    assert one.tolist() == [t for d in docs for t in [*d.encode(), 256]]
    with open(data, "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    grown = token_store(data, ByteTokenizer(), cache=tmp_path / "cache", log=lines.append)
    assert len(lines) == 6 and grown.tolist()[-9:] == [*b"one more", 256]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()) == sorted(
        p.name for p in (tmp_path / "cache").iterdir() if p.suffix != ".lock")   # no scratch folder left


def test_an_unwritable_cache_is_named_in_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    data = tmp_path / "docs.txt"
    data.write_text("hello\n")
    with pytest.raises(ConfigError, match=r"^--data-cache .*file/cache: could not write the tokenized dataset there "
                                          r"\(Not a directory\); choose another --data-cache$"):
        token_store(data, ByteTokenizer(), cache=tmp_path / "file" / "cache")


def test_a_cache_on_a_file_system_without_locks_is_named_and_the_build_goes_on(tmp_path, monkeypatch):
    """flock failing as on a shared file system mounted without it (ENOSYS), as RunFolder meets it too: one warning
    naming --data-cache and what is not kept apart; the run trains its 2 steps (losses finite) on the store it built,
    which holds every line's bytes and end token, and a second look reads it without building it again."""
    def no_locks(*args):
        raise OSError(38, "Function not implemented")
    monkeypatch.setattr(data_module, "fcntl", SimpleNamespace(flock=no_locks, LOCK_EX=2))
    text, cache = tmp_path / "docs.txt", tmp_path / "cache"
    text.write_text("the cat sat on the mat\n" * 60)
    warned = rf"--data-cache {cache} takes no file lock \(Function not implemented\): processes that find this dataset "
    with pytest.warns(UserWarning, match=warned + "untokenized at once"):
        losses = train_app.train(train_app.parse_args(["qwen3", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                                                       "--data", str(text), "--data-cache", str(cache), "--save-every",
                                                       "0", "--out", str(tmp_path / "run"), "--quiet", "--device", "cpu"]))
    assert len(losses) == 2 and all(np.isfinite(losses))
    lines = []
    with pytest.warns(UserWarning, match=warned):
        tokens = token_store(text, ByteTokenizer(), cache=cache, log=lines.append)
    assert lines == [] and tokens.tolist() == [*b"the cat sat on the mat", 256] * 60


PEAK = """
import sys, threading, time
sys.path[:0] = {paths}
from pith_apps.data import ByteTokenizer, token_store
import datasets, numpy, torch   # imports first: their memory is not the build's

def anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

base, peak, done = anon_kib(), [0], []
def sample():
    while not done:
        peak[0] = max(peak[0], anon_kib())
        time.sleep(0.005)
thread = threading.Thread(target=sample)
thread.start()
tic = time.perf_counter()
tokens = token_store({data!r}, ByteTokenizer(), cache={cache!r}, workers=1, log=lambda line: None)
done.append(1)
thread.join()
print(len(tokens), (peak[0] - base) * 1024, time.perf_counter() - tic)
"""


def build_growth(tmp_path, documents: int) -> tuple[int, int, float]:
    """(tokens, growth of anonymous memory in bytes, seconds) of building the store of `documents` 1 KB
    JSON-lines documents in a process of its own, sampling its anonymous resident memory every 5 ms (not the
    page cache of the files it maps)."""
    data = tmp_path / "docs.jsonl"
    write_docs(data, documents, 1000)
    script = PEAK.format(paths=[p for p in sys.path if p], data=str(data), cache=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-2000:]
    tokens, grown, seconds = done.stdout.split()
    return int(tokens), int(grown), float(seconds)


def test_a_corpus_is_tokenized_without_holding_it_or_its_tokens_in_memory(tmp_path):
    """128 MB of text, 128 M tokens: a 512 MB token array. Measured: the build grows by about 110 MiB, nearly
    all of it `datasets` reading JSON, whatever the size (86 MiB for 24 MB of text)."""
    tokens, grown, _ = build_growth(tmp_path, 128_000)
    assert tokens > 125_000_000
    assert grown < tokens * 4 / 3, f"the build grew anonymous memory by {grown / 2**20:.0f} MiB"


@pytest.mark.skipif(not os.environ.get("PITH_SLOW"), reason="opt-in (PITH_SLOW=1): 2 GB of text, 8 GB of tokens")
def test_a_multi_gigabyte_corpus_is_tokenized_in_a_fraction_of_its_size_in_memory(tmp_path):
    tokens, grown, seconds = build_growth(tmp_path, 2_000_000)
    print(f"{tokens:,} tokens ({tokens * 4 / 2**30:.1f} GiB) in {seconds:.0f} s, memory grew {grown / 2**20:.0f} MiB")
    assert tokens > 1_990_000_000
    assert grown < tokens * 4 / 20


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v2", "gpt_oss", "qwen3_5"])
def test_a_document_masked_sequence_gives_each_document_the_logits_it_has_alone(family):
    """Two sequences of 3 and 2 documents (GPT-OSS's sliding window set to 4 tokens, which documents of 9 and 71
    cross; Qwen3.5's delta rule works in chunks of 64 tokens, which the second and fourth documents cross, and its
    convolution reads 3 tokens back): with docs, each document's logits are those of the document run alone
    (float32, 1e-5; Qwen3.5 5e-5: a document starting mid-chunk is solved in other chunks than alone, and the
    triangular solves amplify float32 rounding, 2.3e-5 seen); without, the later documents' differ."""
    from conftest import relative_error
    from pith_apps.config import read_json
    from pith_apps.options import MODELS, PRESETS
    from pith_apps.data import document_ids
    config_cls, model_cls = MODELS[family]
    window = {"sliding_window": 4} if family == "gpt_oss" else {}
    model = model_cls(config_cls.from_dict(read_json(PRESETS / f"{family}_tiny.json") | {"initializer_range": 0.2} | window))
    model.init_weights(seed=1)
    eos, generator = 256, torch.Generator().manual_seed(0)
    lengths, tolerance = [[5, 69, 4], [71, 7]], 5e-5 if family == "qwen3_5" else 1e-5
    rows = [torch.cat([torch.cat([torch.randint(0, 256, (n - 1,), generator=generator), torch.tensor([eos])])
                       for n in row]) for row in lengths]
    ids = torch.stack(rows)
    docs = document_ids(ids, eos)
    assert docs.tolist()[1] == [0] * 71 + [1] * 7
    with torch.no_grad():
        masked, plain = model(ids, docs=docs), model(ids)
        for row, row_lengths in enumerate(lengths):
            start = 0
            for n in row_lengths:
                alone = model(ids[row:row + 1, start:start + n])[0]
                assert relative_error(masked[row, start:start + n], alone) < tolerance, (row, start)
                if start:
                    assert relative_error(plain[row, start:start + n], alone) > 1e-2
                start += n


def test_a_hub_name_goes_to_the_hub_and_a_missing_path_is_named(tmp_path, monkeypatch):
    """owner/name that is no local path is asked of the Hugging Face hub; offline here (tests have no network),
    the hub's refusal is one line. A missing file is named as a missing path, not sent to the hub."""
    import datasets
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=r"^dataset 'someone/stories' is no local file or folder, and the Hugging Face "
                                          r"hub did not give it: .*someone/stories"):
        token_store("someone/stories", ByteTokenizer(), cache=tmp_path)
    with pytest.raises(ConfigError, match=r"^dataset path '.*missing\.jsonl' does not exist; give a "):
        token_store(tmp_path / "missing.jsonl", ByteTokenizer(), cache=tmp_path)
    assert not any(tmp_path.glob("*.building"))   # the failed build left no scratch folder
