"""grain input pipelines for the trainer: pretraining corpus and SFT conversations.

The trainer's whole interface::

    ds = make_pretrain_dataset(data_config, tokenizer, seq_len=256, global_batch_size=8,
                               seed=0, process_index=0, process_count=1, split="train")
    it = iter(ds)                      # a grain DatasetIterator
    batch = next(it)                   # dict of int32 np.ndarray [8 // process_count, 256]
    state = it.get_state()             # JSON-serialisable dict: put it in the checkpoint
    it = iter(ds); it.set_state(state) # a fresh iterator resumes with the very same batches

``make_sft_dataset`` has the same signature and yields the same batch dict. Batch
keys (``packing.BATCH_KEYS``): ``tokens`` (inputs), ``targets`` (next tokens,
already shifted per document), ``loss_mask`` (1 = train this target), ``segment_ids``
(1..k per example in a row, 0 = padding) and ``positions`` (restart at 0 per
segment). Loss = sum(ce(tokens → targets) * loss_mask) / sum(loss_mask);
attention must not cross ``segment_ids``.

Stages (each a grain transformation, so ``get_state``/``set_state`` is exact):

1. documents: the configured sources, sharded by process (``[index::count]``
   before anything is read), filtered by split and by the benchmark guard;
2. a global shuffle, reshuffled every epoch, repeating forever (the trainer counts
   steps; eval takes a fixed number of batches from a fresh iterator);
3. tokenize (threads via ``read_threads``): ``<|bos|>`` + text + ``<|eos|>``; an SFT
   conversation is rendered by the chat format (``RenderConversation``);
4. split examples longer than ``seq_len`` into chunks (SFT: ``sft_max_chunks``);
5. window-shuffle chunks (``shuffle_window``), so one long file does not fill whole
   batches by itself;
6. pack (first-fit or best-fit) and batch.

Split: a document belongs to the eval split when a hash of its whitespace-normalised
content falls below ``eval_fraction``: independent of source order, sharding and
file names, and identical copies always land on the same side.

Multi-host: every process builds the pipeline with its own ``process_index`` and
the global batch size, and gets ``global_batch_size // process_count`` rows of its
own documents. The state belongs to that process (save one per process); it
resumes exactly only with the same ``process_count``, seed and config.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grain

from cursor_rl.chat import protocol
from cursor_rl.chat.tokenizer import SPECIAL_TOKENS, Tokenizer
from cursor_rl.data import packing, sft, sources, synthetic

SPLITS = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What to read and how to batch it.

    Attributes:
      sources: corpus spec strings (see ``cursor_rl.data.sources``), e.g.
        ``("stdlib",)`` or ``("stdlib", "jsonl:/data/code/*.jsonl")``.
      weights: per-source sampling weights; empty means every document is drawn
        once per epoch (natural proportions).
      text_field: the JSON field holding text in JSONL/ArrayRecord sources.
      exclude_modules: stdlib modules reserved for evaluation; None means
        ``cursor_rl.data.splits.BENCH_MODULES``; ``()`` excludes nothing.
      eval_fraction: share of documents held out for eval loss (by content hash).
      packing: ``first_fit`` or ``best_fit``.
      packing_bins: rows packed together (0: four times the per-process batch).
      shuffle_window: chunks shuffled together after splitting long documents
        (0 disables).
      read_threads: threads reading and tokenizing documents.
      sft_sources: SFT conversation sources: ``builtin`` (the generated agent
        trajectories) and/or JSONL globs of ``{"messages": [...]}`` records.
      sft_max_chunks: ``seq_len`` chunks kept from a longer conversation: 0 keeps
        all (the default: agent trajectories outgrow short contexts — the harness's
        system prompt alone is ~1k tokens at a 2k vocabulary — and later chunks still
        teach the tool calls); 1 truncates (every example keeps its system prompt).
      sft_eval_fraction: share of conversations held out (SFT sets are small).
      seqio_mixture: when set, pretraining batches come from this seqio Mixture or
        Task instead of ``sources`` (needs the ``seqio`` extra; see
        ``cursor_rl.data.seqio_bridge``).
      seqio_modules: modules imported first, to register the seqio Tasks/Mixtures.
      repeat_rows: share of pretraining rows (train split only) replaced by rows of
        repeated random spans (``cursor_rl.data.synthetic``), which make copying from
        context learnable; 0 = off.
      repeat_min_len, repeat_max_len: span lengths of those rows.
    """

    sources: tuple[str, ...] = ("stdlib",)
    weights: tuple[float, ...] = ()
    text_field: str = "text"
    exclude_modules: tuple[str, ...] | None = None
    eval_fraction: float = 0.05
    packing: str = "first_fit"
    packing_bins: int = 0
    shuffle_window: int = 512
    read_threads: int = 2
    sft_sources: tuple[str, ...] = ("builtin",)
    sft_max_chunks: int = 0
    sft_eval_fraction: float = 0.1
    seqio_mixture: str = ""
    seqio_modules: tuple[str, ...] = ()
    repeat_rows: float = 0.0
    repeat_min_len: int = 8
    repeat_max_len: int = 100

    def __post_init__(self):
        if not self.sources:
            raise ValueError("data.sources is empty: name at least one corpus source")
        if self.weights and len(self.weights) != len(self.sources):
            raise ValueError(
                f"data.weights has {len(self.weights)} entries for {len(self.sources)} sources"
            )
        if any(w <= 0 for w in self.weights):
            raise ValueError(f"data.weights={self.weights}: weights must be positive")
        for name in ("eval_fraction", "sft_eval_fraction"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"data.{name}={getattr(self, name)} must be in (0, 1)")
        if self.packing not in packing.PACKING_STRATEGIES:
            raise ValueError(
                f"data.packing={self.packing!r} must be one of {packing.PACKING_STRATEGIES}"
            )
        for name in ("packing_bins", "shuffle_window", "sft_max_chunks"):
            if getattr(self, name) < 0:
                raise ValueError(f"data.{name}={getattr(self, name)} must be >= 0")
        if self.read_threads < 1:
            raise ValueError(f"data.read_threads={self.read_threads} must be >= 1")
        if not 0.0 <= self.repeat_rows <= 1.0:
            raise ValueError(f"data.repeat_rows={self.repeat_rows} must be in [0, 1]")
        if not 1 <= self.repeat_min_len <= self.repeat_max_len:
            raise ValueError(
                f"data.repeat_min_len={self.repeat_min_len} and data.repeat_max_len="
                f"{self.repeat_max_len}: need 1 <= min <= max"
            )

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> DataConfig:
        """Builds the config from a dict or ``ml_collections.ConfigDict`` (lists → tuples)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(mapping) - fields)
        if unknown:
            raise ValueError(f"unknown data config fields {unknown}; known: {sorted(fields)}")
        values = {}
        for key in mapping:
            value = mapping[key]
            values[key] = tuple(value) if isinstance(value, list | tuple) else value
        return cls(**values)


def split_of(text: str, eval_fraction: float) -> str:
    """``"eval"`` or ``"train"`` for a document, by a hash of its normalised content."""
    digest = sources.normalized_hash(text)
    bucket = int.from_bytes(digest[:8], "little") / 2**64
    return "eval" if bucket < eval_fraction else "train"


class _KeepDocument:
    """grain filter: the document is in ``split`` and is not a benchmark copy."""

    def __init__(self, split: str, eval_fraction: float, guard: sources.BenchGuard):
        self.split = split
        self.eval_fraction = eval_fraction
        self.guard = guard

    def __call__(self, document: sources.Document) -> bool:
        text = document["text"]
        return split_of(text, self.eval_fraction) == self.split and not self.guard.is_reserved(text)


class RenderConversation:
    """grain map: a conversation to an SFT example (loss on assistant tokens only)."""

    def __init__(self, tokenizer: Tokenizer):
        self.chat = protocol.ChatFormat(tokenizer)

    def __call__(self, conversation: Mapping[str, Any]) -> packing.Example | None:
        trajectory = self.chat.render(conversation["messages"])
        return packing.example_from_ids(trajectory.tokens, trajectory.loss_mask)


class _TokenizeDocument:
    """grain map: a document to an (inputs, targets, loss_mask) example, or None."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.bos = tokenizer.bos_id if tokenizer.has_special("<|bos|>") else None
        self.eos = tokenizer.eos_id if tokenizer.has_special("<|eos|>") else None

    def __call__(self, document: sources.Document) -> packing.Example | None:
        ids = self.tokenizer.encode(document["text"])
        if self.bos is not None:
            ids.insert(0, self.bos)
        if self.eos is not None:
            ids.append(self.eos)
        return packing.example_from_ids(ids)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")


def per_process_batch_size(global_batch_size: int, process_index: int, process_count: int) -> int:
    """Rows per process; checks the process index and that the batch divides evenly."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is outside 0..{process_count - 1}")
    if global_batch_size < 1 or global_batch_size % process_count:
        raise ValueError(
            f"global_batch_size={global_batch_size} must be a positive multiple of "
            f"process_count={process_count}"
        )
    return global_batch_size // process_count


def open_sources(config: DataConfig) -> list[Any]:
    """Opens every configured corpus source (random-access document sequences)."""
    return [
        sources.open_source(
            spec, text_field=config.text_field, exclude_modules=config.exclude_modules
        )
        for spec in config.sources
    ]


def bench_guard(config: DataConfig, opened: Sequence[Any] = ()) -> sources.BenchGuard:
    """The exact-copy guard for the reserved modules (reusing an opened stdlib source)."""
    for source in opened:
        if isinstance(source, sources.StdlibSource):
            return sources.BenchGuard(source.excluded_texts())
    exclude = config.exclude_modules
    if exclude is None:
        exclude = sources.default_excluded_modules()
    if not exclude:
        return sources.BenchGuard(())
    return sources.BenchGuard.for_stdlib(exclude)


def _first_kept(dataset: grain.MapDataset, what: str) -> None:
    # A shard whose filter keeps nothing would make `repeat()` spin forever; fail now.
    for index in range(len(dataset)):
        if dataset[index] is not None:
            return
    raise ValueError(f"{what} has no documents (shard empty after split/benchmark filtering)")


def document_dataset(
    config: DataConfig,
    *,
    split: str,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.MapDataset:
    """This process's documents of ``split``, shuffled per epoch, repeated forever.

    Args:
      config: the data config.
      split: ``train`` or ``eval``.
      seed: shuffle seed.
      process_index: this process (``jax.process_index()``).
      process_count: all processes (``jax.process_count()``).

    Returns:
      An infinite MapDataset of documents (filtered-out indices are None).
    """
    _check_split(split)
    opened = open_sources(config)
    keep = _KeepDocument(split, config.eval_fraction, bench_guard(config, opened))
    per_source = []
    for spec, source in zip(config.sources, opened):
        if len(source) == 0:
            raise ValueError(f"corpus source {spec!r} is empty")
        docs = grain.MapDataset.source(source)[process_index::process_count].filter(keep)
        per_source.append(docs)
    if config.weights:
        shuffled = []
        for i, (spec, docs) in enumerate(zip(config.sources, per_source)):
            docs = docs.shuffle(seed=(seed + 7919 * i) % 2**32)
            _first_kept(docs, f"source {spec!r}, {split} split, process {process_index}")
            shuffled.append(docs.repeat())
        return grain.MapDataset.mix(shuffled, weights=list(config.weights))
    docs = grain.MapDataset.concatenate(per_source).shuffle(seed=seed % 2**32)
    _first_kept(docs, f"corpus {list(config.sources)}, {split} split, process {process_index}")
    return docs.repeat()


def batches_from_examples(
    examples: grain.IterDataset,
    config: DataConfig,
    *,
    seq_len: int,
    local_batch_size: int,
    pad_id: int,
    seed: int,
    max_chunks: int | None = None,
) -> grain.IterDataset:
    """Stages 4-6 shared by every pipeline: split, window-shuffle, pack, batch.

    Args:
      examples: an IterDataset of ``packing.example_from_ids`` examples.
      config: the data config (packing and shuffle-window settings).
      seq_len: row length.
      local_batch_size: rows per batch on this process.
      pad_id: id written into padding.
      seed: seeds the window shuffle and the packed-row shuffle.
      max_chunks: chunks kept per example (None: all).

    Returns:
      An IterDataset of batch dicts.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2")
    chunks = grain.experimental.FlatMapIterDataset(
        examples, packing.SplitToSeqLen(seq_len, max_chunks)
    )
    if config.shuffle_window > 1:
        chunks = grain.experimental.WindowShuffleIterDataset(
            chunks, window_size=config.shuffle_window, seed=seed % 2**32
        )
    return packing.pack_and_batch(
        chunks,
        seq_len=seq_len,
        batch_size=local_batch_size,
        strategy=config.packing,
        num_packing_bins=config.packing_bins,
        pad_id=pad_id,
        seed=seed,
    )


def make_pretrain_dataset(
    config: DataConfig,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    split: str = "train",
) -> grain.IterDataset:
    """The packed pretraining pipeline (short- and long-context stages).

    Args:
      config: the data config.
      tokenizer: the run's tokenizer.
      seq_len: row length (tokens per row).
      global_batch_size: rows per step over all processes.
      seed: fixes document order, chunk shuffle and packing.
      process_index: this process (``jax.process_index()``).
      process_count: all processes (``jax.process_count()``).
      split: ``train`` or ``eval`` (held-out documents).

    Returns:
      An infinite IterDataset of batch dicts (``packing.BATCH_KEYS``), int32
      ``[global_batch_size // process_count, seq_len]``; ``iter()`` it for a
      checkpointable iterator.
    """
    local = per_process_batch_size(global_batch_size, process_index, process_count)
    if config.seqio_mixture:
        # Imported only here: the bridge needs TensorFlow (the optional seqio extra;
        # tools/import_graph.py lists this import in DEFERRED).
        from cursor_rl.data import seqio_bridge

        return seqio_bridge.make_seqio_dataset(
            config,
            tokenizer,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            seed=seed,
            process_index=process_index,
            process_count=process_count,
            split=split,
        )
    docs = document_dataset(
        config, split=split, seed=seed, process_index=process_index, process_count=process_count
    )
    examples = docs.map(_TokenizeDocument(tokenizer)).to_iter_dataset(
        grain.ReadOptions(num_threads=config.read_threads, prefetch_buffer_size=4 * local)
    )
    batches = batches_from_examples(
        examples,
        config,
        seq_len=seq_len,
        local_batch_size=local,
        pad_id=tokenizer.pad_id,
        seed=seed,
    )
    if config.repeat_rows > 0 and split == "train":
        # Spans are capped so a span, its largest gap and its repeat fit one row: a
        # short --config.train.seq_len still runs, with shorter repeats.
        max_len = max(1, min(config.repeat_max_len, (seq_len + 1) // 3))
        spec = synthetic.RepeatSpec(
            low=len(SPECIAL_TOKENS),
            high=tokenizer.vocab_size,
            min_len=min(config.repeat_min_len, max_len),
            max_len=max_len,
        )
        spec.check_fits(seq_len)
        replace = synthetic.ReplaceRows(config.repeat_rows, spec, tokenizer.pad_id)
        batches = batches.random_map(replace, seed=(seed + 104729) % 2**32)
    return batches


def make_sft_dataset(
    config: DataConfig,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    split: str = "train",
) -> grain.IterDataset:
    """The packed SFT pipeline over ``config.sft_sources``; same batches as pretraining.

    ``loss_mask`` is 1 only where the target is one of the assistant's own tokens.
    Conversations longer than ``seq_len`` keep ``config.sft_max_chunks`` chunks.

    Args:
      config: the data config (``sft_*`` fields, packing settings).
      tokenizer: the run's tokenizer (with the chat special tokens).
      seq_len: row length.
      global_batch_size: rows per step over all processes.
      seed: fixes conversation order and packing.
      process_index: this process (``jax.process_index()``).
      process_count: all processes (``jax.process_count()``).
      split: ``train`` or ``eval`` (held out by content hash, ``sft_eval_fraction``).

    Returns:
      An infinite IterDataset of batch dicts (``packing.BATCH_KEYS``).
    """
    _check_split(split)
    local = per_process_batch_size(global_batch_size, process_index, process_count)
    conversations = sft.open_conversations(config.sft_sources)
    keep = _KeepDocument(split, config.sft_eval_fraction, sources.BenchGuard(()))
    convs = grain.MapDataset.source(conversations)[process_index::process_count].filter(keep)
    convs = convs.shuffle(seed=seed % 2**32)
    _first_kept(convs, f"SFT sources {list(config.sft_sources)}, {split} split")
    render = RenderConversation(tokenizer)
    max_chunks = config.sft_max_chunks or None
    _check_sft_fits(convs, render, seq_len, max_chunks)
    examples = (
        convs.repeat()
        .map(render)
        .to_iter_dataset(grain.ReadOptions(num_threads=config.read_threads))
    )
    return batches_from_examples(
        examples,
        config,
        seq_len=seq_len,
        local_batch_size=local,
        pad_id=tokenizer.pad_id,
        seed=seed,
        max_chunks=max_chunks,
    )


def _check_sft_fits(
    convs: grain.MapDataset, render: Any, seq_len: int, max_chunks: int | None, sample: int = 64
) -> None:
    """Fails early when truncation would leave no assistant token to train on.

    Otherwise every conversation renders to chunks without loss, all are dropped and
    the infinite pipeline never yields a batch.
    """
    kept = [c for c in (convs[i] for i in range(min(len(convs), 4 * sample))) if c][:sample]
    examples = [e for e in map(render, kept) if e is not None]
    if not any(packing.split_example(e, seq_len, max_chunks) for e in examples):
        first = min(int(e["loss_mask"].argmax()) + 1 for e in examples) if examples else 0
        raise ValueError(
            f"seq_len={seq_len} with data.sft_max_chunks={max_chunks or 0} leaves no assistant "
            f"token to train on: the first one comes after {first} tokens. Raise seq_len or "
            "set data.sft_max_chunks=0 (keep later chunks)."
        )


def make_pretrain_iterator(*args: Any, **kwargs: Any) -> grain.DatasetIterator:
    """``iter(make_pretrain_dataset(...))``: a checkpointable iterator of batches."""
    return iter(make_pretrain_dataset(*args, **kwargs))


def make_sft_iterator(*args: Any, **kwargs: Any) -> grain.DatasetIterator:
    """``iter(make_sft_dataset(...))``: a checkpointable iterator of SFT batches."""
    return iter(make_sft_dataset(*args, **kwargs))


def iter_documents(
    config: DataConfig, *, split: str | None = None, seed: int | None = None
) -> Iterator[sources.Document]:
    """Every usable document once (benchmark copies dropped), for stats and tokenizers.

    Args:
      config: the data config.
      split: only this split's documents; None yields both.
      seed: None reads sources in order; an int shuffles (for sampling a prefix).

    Yields:
      Documents, each with an added ``"split"`` key.
    """
    if split is not None:
        _check_split(split)
    opened = open_sources(config)
    guard = bench_guard(config, opened)
    order = [(s, i) for s, source in enumerate(opened) for i in range(len(source))]
    if seed is not None:
        random.Random(seed).shuffle(order)
    for s, i in order:
        document = opened[s][i]
        if document is None or guard.is_reserved(document["text"]):
            continue
        document_split = split_of(document["text"], config.eval_fraction)
        if split is None or document_split == split:
            yield {**document, "split": document_split}


def train_tokenizer(
    config: DataConfig,
    vocab_size: int,
    *,
    max_chars: int = 8_000_000,
    seed: int = 0,
    min_frequency: int = 2,
) -> Tokenizer:
    """Trains the byte-level BPE tokenizer on a seeded sample of the train split.

    Args:
      config: the data config naming the corpus.
      vocab_size: vocabulary size including special tokens.
      max_chars: character budget (8M: ~2-3 s on 2 cores, merges already stable).
      seed: which documents form the sample.
      min_frequency: minimum pair count to merge.

    Returns:
      The trained tokenizer.
    """
    texts = (d["text"] for d in iter_documents(config, split="train", seed=seed))
    return Tokenizer.train(texts, vocab_size, min_frequency=min_frequency, max_chars=max_chars)
