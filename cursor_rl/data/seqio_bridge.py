"""seqio bridge: the corpus as a seqio Task, and seqio Mixtures feeding the same trainer.

Optional (the ``seqio`` extra pulls TensorFlow). Two directions:

- ``register_corpus_task(name, data_config, tokenizer)`` registers any corpus this
  package reads (stdlib, files, JSONL, ArrayRecord; benchmark exclusion and the
  train/eval split included) as a seqio Task with a ``targets`` feature, so it can
  join seqio Mixtures next to existing TFDS/seqio Tasks.
- ``make_seqio_dataset`` turns a registered Mixture or Task into the trainer's batch
  dict. ``make_pretrain_dataset`` calls it when ``data.seqio_mixture`` is set, after
  importing ``data.seqio_modules`` (the modules that register the Tasks).

Design choices:

1. **seqio reads, grain packs.** seqio yields tokenized ``targets``; the examples
   then go through the very stages the native pipeline uses (split into
   ``seq_len`` chunks, window shuffle, first/best-fit packing, batch), so the batch
   dict, ``loss_mask``, ``segment_ids`` and ``positions`` are identical in form.
   seqio's own ``trim_and_pack`` is not used (it names features differently and
   drops overflow instead of chunking it).
2. **Same tokens as the native pipeline.** The Task's vocabulary wraps our
   ``Tokenizer``; seqio appends ``<|eos|>`` (``add_eos``) and the bridge prepends
   ``<|bos|>``: ``<|bos|> text <|eos|>``, as ``make_pretrain_dataset`` renders it.
3. **Checkpointable by replay.** A tf.data iterator has no JSON state, so the
   state is the number of examples consumed; restoring rebuilds the seqio dataset
   with the same seed and shard and skips that many. seqio's pipeline is
   deterministic for a fixed seed (seeded shuffle and mixture sampling; tf.data
   keeps order in parallel maps), so the resumed batches are the same; restore costs
   time proportional to the position.
4. **Sharding** uses seqio's ``ShardInfo(process_index, process_count)``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np
import seqio
import tensorflow as tf

from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.data import packing, pipeline

FEATURE = "targets"


class TokenizerVocabulary(seqio.Vocabulary):
    """A seqio Vocabulary backed by the project's byte-level BPE ``Tokenizer``."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        super().__init__(extra_ids=0)

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_id if self.tokenizer.has_special("<|eos|>") else None

    @property
    def unk_id(self) -> int | None:
        return None  # byte-level BPE has no unknown token

    @property
    def _base_vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def _encode(self, s: str) -> list[int]:
        return self.tokenizer.encode(s)

    def _decode(self, ids: Any) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def _encode_tf(self, s: tf.Tensor) -> tf.Tensor:
        def encode(text: bytes) -> np.ndarray:
            return np.asarray(self.tokenizer.encode(text.decode("utf-8")), dtype=np.int32)

        ids = tf.numpy_function(encode, [s], tf.int32, stateful=False)
        ids.set_shape([None])
        return ids

    def _decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
        def decode(values: np.ndarray) -> bytes:
            return self._decode(values).encode("utf-8")

        text = tf.numpy_function(decode, [ids], tf.string, stateful=False)
        text.set_shape([])
        return text

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TokenizerVocabulary)
            and self.tokenizer.to_json() == other.tokenizer.to_json()
        )

    def __hash__(self) -> int:
        return hash(self.tokenizer.to_json())


def register_corpus_task(
    name: str, config: pipeline.DataConfig, tokenizer: Tokenizer
) -> seqio.Task:
    """Registers ``config``'s corpus as the seqio Task ``name`` (splits ``train``, ``eval``).

    Args:
      name: the Task name (replaces an existing Task of that name).
      config: names the sources; its exclusions and eval split apply.
      tokenizer: tokenizes the ``targets`` feature.

    Returns:
      The registered Task.
    """

    def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
        del shuffle_files, seed  # seqio's seeded Task shuffle orders the documents

        def texts() -> Iterator[str]:
            for document in pipeline.iter_documents(config, split=split):
                yield document["text"]

        ds = tf.data.Dataset.from_generator(
            texts, output_signature=tf.TensorSpec(shape=(), dtype=tf.string)
        )
        return ds.map(lambda text: {"text": text})

    seqio.TaskRegistry.remove(name)
    return seqio.TaskRegistry.add(
        name,
        source=seqio.FunctionDataSource(dataset_fn, splits=pipeline.SPLITS),
        preprocessors=[
            functools.partial(seqio.preprocessors.rekey, key_map={FEATURE: "text"}),
            seqio.preprocessors.tokenize,
            seqio.preprocessors.append_eos,
        ],
        output_features={
            FEATURE: seqio.Feature(TokenizerVocabulary(tokenizer), add_eos=True, dtype=tf.int32)
        },
    )


class _SeqioExamplesIterator(grain.DatasetIterator):
    """Examples from a seqio provider; the state is the number consumed (choice 3)."""

    def __init__(self, spec: _SeqioExamples):
        super().__init__()
        self._spec = spec
        self._consumed = 0
        self._numpy_iterator = self._open(0)

    def _open(self, skip: int) -> Iterator[dict[str, np.ndarray]]:
        spec = self._spec
        provider = seqio.get_mixture_or_task(spec.name)
        ds = provider.get_dataset(
            sequence_length=None,
            split=spec.split,
            shuffle=True,
            seed=spec.seed,
            shard_info=seqio.ShardInfo(spec.process_index, spec.process_count),
            num_epochs=None,
            use_cached=False,
        )
        return ds.skip(skip).as_numpy_iterator()

    def __next__(self) -> packing.Example | None:
        while True:
            features = next(self._numpy_iterator)
            self._consumed += 1
            ids = features[FEATURE].astype(np.int32).tolist()
            if self._spec.bos_id is not None:
                ids.insert(0, self._spec.bos_id)
            example = packing.example_from_ids(ids)
            if example is not None:
                return example

    def get_state(self) -> dict[str, Any]:
        return {"consumed": self._consumed}

    def set_state(self, state: dict[str, Any]) -> None:
        self._consumed = int(state["consumed"])
        self._numpy_iterator = self._open(self._consumed)


class _SeqioExamples(grain.IterDataset):
    """An IterDataset over a registered seqio Mixture or Task."""

    def __init__(
        self,
        name: str,
        *,
        split: str,
        seed: int,
        process_index: int,
        process_count: int,
        bos_id: int | None,
    ):
        super().__init__()
        self.name = name
        self.split = split
        self.seed = seed
        self.process_index = process_index
        self.process_count = process_count
        self.bos_id = bos_id

    def __iter__(self) -> _SeqioExamplesIterator:
        return _SeqioExamplesIterator(self)


def make_seqio_dataset(
    config: pipeline.DataConfig,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    split: str = "train",
) -> grain.IterDataset:
    """Batches from the seqio Mixture/Task ``config.seqio_mixture`` (same batch dict).

    Args:
      config: ``seqio_mixture`` names the provider; ``seqio_modules`` register it;
        packing settings as for the native pipeline.
      tokenizer: the run's tokenizer (its ``<|bos|>`` is prepended).
      seq_len: row length.
      global_batch_size: rows per step over all processes.
      seed: seqio shuffle/mixing seed and packing seed.
      process_index: this process.
      process_count: all processes.
      split: the seqio split name (``train``/``eval`` for Tasks registered here).

    Returns:
      An infinite IterDataset of batch dicts (``packing.BATCH_KEYS``).
    """
    local = pipeline.per_process_batch_size(global_batch_size, process_index, process_count)
    for module in config.seqio_modules:
        importlib.import_module(module)
    try:
        seqio.get_mixture_or_task(config.seqio_mixture)
    except ValueError as e:
        raise ValueError(
            f"data.seqio_mixture={config.seqio_mixture!r} is not registered "
            f"(data.seqio_modules={list(config.seqio_modules)}): {e}"
        ) from None
    examples = _SeqioExamples(
        config.seqio_mixture,
        split=split,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
        bos_id=tokenizer.bos_id if tokenizer.has_special("<|bos|>") else None,
    )
    return pipeline.batches_from_examples(
        examples,
        config,
        seq_len=seq_len,
        local_batch_size=local,
        pad_id=tokenizer.pad_id,
        seed=seed,
    )
