"""Talk to a checkpoint from the terminal, with the reply streamed as it is sampled.

    python -m cursor_rl.sampler.chat --workdir=DIR [--temperature=0.7]
    python -m cursor_rl.sampler.chat --checkpoint=DIR/sft/checkpoints/300

``--workdir`` picks the newest checkpoint of the latest stage present (RL policy,
then SFT, long-context, pretraining). The tokenizer comes from the checkpoint's
metadata, else ``WORKDIR/tokenizer``. Conversations use the harness's chat format
(``cursor_rl.chat.protocol``) and live in one sampler session, so each new line
only prefills itself. ``/reset`` starts a new conversation; end of input quits.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from typing import TextIO

from absl import app, flags

from cursor_rl import checkpoints
from cursor_rl.chat.protocol import ChatFormat, Message, Trajectory
from cursor_rl.chat.tokenizer import Tokenizer
from cursor_rl.sampler.sampler import Sampler
from cursor_rl.sampler.sampling import SamplingParams
from cursor_rl.workdir import Workdir


def _stage_dirs(workdir: Workdir) -> list:
    """Where checkpoints live, latest stage first (what a researcher most likely wants)."""
    return [
        workdir.policy_dir,
        workdir.checkpoint_dir("sft"),
        workdir.checkpoint_dir("long_context"),
        workdir.checkpoint_dir("pretrain"),
    ]


def find_checkpoint(workdir: Workdir | str) -> str:
    """The newest checkpoint of the latest stage in ``workdir``."""
    workdir = Workdir.of(workdir)
    for stage_dir in _stage_dirs(workdir):
        path = checkpoints.latest_checkpoint(stage_dir)
        if path is not None:
            return path
    looked = ", ".join(str(d) for d in _stage_dirs(workdir))
    raise FileNotFoundError(f"no checkpoint under {workdir} (looked in {looked})")


def load_sampler(checkpoint: str, workdir: Workdir | str | None = None, **options) -> Sampler:
    """A sampler for ``checkpoint`` with a tokenizer (metadata's, else the workdir's)."""
    metadata = checkpoints.read_metadata(checkpoint)
    if "tokenizer" in metadata:
        tokenizer = Tokenizer.from_json(metadata["tokenizer"])
    elif workdir is not None:
        tokenizer = Tokenizer.load(Workdir.of(workdir).tokenizer_file)
    else:
        raise FileNotFoundError(f"{checkpoint} has no tokenizer in its metadata; pass --workdir")
    return Sampler.from_checkpoint(checkpoint, tokenizer=tokenizer, **options)


def chat(
    sampler: Sampler,
    lines: Iterable[str],
    out: TextIO,
    params: SamplingParams,
    system: str | None = None,
) -> Trajectory:
    """Answers each input line as a user turn, streaming replies to ``out``.

    Returns:
      The last conversation as a trajectory (sampled tokens with their log-probs).
    """
    fmt = ChatFormat(sampler.tokenizer)
    stops = tuple(params.stop_token_ids) + fmt.stop_token_ids
    params = dataclasses.replace(params, stop_token_ids=stops)
    traj, session = None, None
    for line in lines:
        line = line.rstrip("\n")
        if line.strip() == "/reset" or traj is None:
            if session is not None:
                sampler.close(session)
            traj, session = Trajectory(), None
            fmt.start_segment(traj)
            if system:
                fmt.append_message(traj, Message("system", system))
            if line.strip() == "/reset":
                continue
        fmt.append_message(traj, Message("user", line))
        fmt.append_assistant_header(traj)
        # The session holds a prefix of the trajectory: send only what it lacks (the
        # user turn, and an <|end|> the format added to close a cut-off reply).
        if session is None:
            session = sampler.open(traj.tokens)
        else:
            sampler.append(session, traj.tokens[len(session.tokens) :])
        sampler.submit(session, params)
        completion = _stream(sampler, session, out)
        fmt.append_sampled(traj, completion.tokens, completion.logprobs)
    return traj


def _stream(sampler: Sampler, session, out: TextIO):
    """Steps the sampler until ``session``'s turn ends, writing new text as it comes."""
    shown = ""
    while True:
        finished = dict((s.id, c) for s, c in sampler.step())
        tokens = finished[session.id].tokens if session.id in finished else session.partial
        text = sampler.tokenizer.decode(tokens, skip_special=True)
        done = session.id in finished
        # Hold a partial multi-byte character back until it is whole (or the turn ends).
        if done or not text.endswith("\ufffd"):
            out.write(text[len(shown) :] + ("\n" if done else ""))
            out.flush()
            shown = text
        if done:
            return finished[session.id]


def main(argv=None) -> None:
    flags.DEFINE_string("workdir", None, "A run's workdir: talk to its latest checkpoint.")
    flags.DEFINE_string("checkpoint", None, "A checkpoint step directory (overrides workdir).")
    flags.DEFINE_string("system", None, "An optional system prompt.")
    flags.DEFINE_integer("max_new_tokens", 512, "Longest reply.")
    flags.DEFINE_float("temperature", 0.7, "0 is greedy.")
    flags.DEFINE_float("top_p", 0.95, "Nucleus sampling.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_integer("max_seq_len", 4096, "Longest conversation in tokens.")

    def run(argv):
        del argv
        f = flags.FLAGS
        if not (f.workdir or f.checkpoint):
            raise app.UsageError("pass --workdir or --checkpoint")
        checkpoint = f.checkpoint or find_checkpoint(f.workdir)
        # Small decode calls so the reply streams smoothly.
        sampler = load_sampler(
            checkpoint, f.workdir, num_slots=1, max_seq_len=f.max_seq_len, decode_steps=4
        )
        print(f"{checkpoint} (policy version {sampler.policy_version}); end input to quit")
        params = SamplingParams(f.max_new_tokens, f.temperature, f.top_p, seed=f.seed)
        lines = _prompted(sys.stdin) if sys.stdin.isatty() else sys.stdin
        chat(sampler, lines, sys.stdout, params, system=f.system)

    app.run(run, argv)


def _prompted(stream: TextIO) -> Iterable[str]:
    """Lines of an interactive terminal, each after a "> " prompt."""
    while True:
        print("> ", end="", flush=True)
        line = stream.readline()
        if not line:
            return
        yield line


if __name__ == "__main__":
    main()
