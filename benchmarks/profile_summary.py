"""What a worker's threads spent their time on, from a py-spy profile (issue 33, item 3).

``py-spy record --threads --idle -f raw`` samples every thread of a process at each tick,
idle or not, and writes one line per distinct stack: ``thread (TID): NAME;frame;...;leaf
COUNT``, each frame ``function (file:line)``. Per thread this sums the samples by what the
stack was doing (the first category, in the order of ``CATEGORIES``, one of whose patterns a
frame matches), so a share is a share of the thread's wall time:

* ``forward pass``: the model's Python (torch.nn modules, torchvision's models): where a
  forward pass run eagerly launches its kernels one by one;
* ``graph replay``: replaying a captured CUDA graph (backend/handlers/graphs.py);
* ``image pipeline``: decoding, resizing and normalising (backend/handlers/images.py);
* ``postprocess``: the outputs read back (top-5, ``.tolist()``: where the thread waits for
  the GPU's results) and turned into answers;
* ``waiting``: blocked with nothing to do (a queue, a lock, a socket read, a sleep; an idle
  pool thread, a watchdog);
* ``other``.

The verdict: the worker is **launch-bound** when its main thread spends at least half of its
time in an eagerly run forward pass's Python; then the GPU waits for Python, not Python for
the GPU.

    python -m benchmarks.profile_summary /tmp/gpu-out/profile/*.txt
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # Before graph replay: a runner that fell back runs the model eagerly from graphs.py.
    ("forward pass", re.compile(r"torch/nn/modules/|torchvision/models/")),
    ("graph replay", re.compile(r"handlers/graphs\.py|torch/cuda/graphs\.py")),
    ("image pipeline", re.compile(r"handlers/images\.py|handlers/jpeg_markers\.py")),
    ("postprocess", re.compile(r"\bpostprocess\b|top_k_labels")),
)
WAITING = "waiting"
OTHER = "other"
#: A leaf frame that blocks: the thread is idle there.
_WAITS = re.compile(r"^(?:\S+\.)?(wait|get|acquire|_wait_for_tstate_lock|select|poll|sleep|"
                    r"recv|recv_into|accept|_read|readline|join|_worker|watch)\s\(")
#: The launch-bound verdict: the main thread's share of time in an eager forward pass.
LAUNCH_BOUND_SHARE = 0.5
MAIN_THREAD = "MainThread"


@dataclass
class ThreadProfile:
    """One thread's samples, by category and by leaf frame."""

    name: str
    samples: int = 0
    categories: Counter[str] = field(default_factory=Counter)
    leaves: Counter[str] = field(default_factory=Counter)

    def share(self, category: str) -> float:
        return self.categories[category] / self.samples if self.samples else 0.0


def categorise(frames: Sequence[str]) -> str:
    """What a stack (root first) was doing."""
    for name, pattern in CATEGORIES:
        if any(pattern.search(frame) for frame in frames):
            return name
    if frames and _WAITS.search(frames[-1]):
        return WAITING
    return OTHER


def _thread_name(frame: str) -> str | None:
    """``thread (123): frame-reader`` -> ``frame-reader`` (None: not a thread frame)."""
    match = re.match(r"thread \(([^)]*)\)(?::\s*(.*))?$", frame)
    if match is None:
        return None
    return match.group(2) or match.group(1)


def parse_raw(text: str) -> dict[str, ThreadProfile]:
    """py-spy's raw (collapsed stack) output, per thread name (threads of one name, such as
    a pool's, are summed)."""
    threads: dict[str, ThreadProfile] = {}
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [frame for frame in stack.split(";") if frame]
        name = _thread_name(frames[0]) if frames else None
        if name is None:
            name = "?"
        else:
            frames = frames[1:]
        name = re.sub(r"_\d+$", "", name)  # a pool's threads: image-decode_0, _1, ...
        profile = threads.setdefault(name, ThreadProfile(name))
        samples = int(count)
        profile.samples += samples
        profile.categories[categorise(frames)] += samples
        if frames:
            profile.leaves[re.sub(r":\d+\)$", ")", frames[-1])] += samples
    return threads


def launch_bound(threads: dict[str, ThreadProfile]) -> bool | None:
    """Whether the main thread's time goes mostly to an eager forward pass (None: no main
    thread in the profile)."""
    main = threads.get(MAIN_THREAD)
    if main is None or not main.samples:
        return None
    return main.share("forward pass") >= LAUNCH_BOUND_SHARE


def summarise(threads: dict[str, ThreadProfile], title: str = "profile") -> str:
    """A few lines: per thread its shares by category and its top leaf frames, then the
    verdict."""
    lines = [f"{title}:"]
    ordered = sorted(threads.values(),
                     key=lambda thread: (thread.name != MAIN_THREAD, -thread.samples))
    for thread in ordered:
        shares = ", ".join(f"{category} {count / thread.samples:.0%}"
                           for category, count in thread.categories.most_common())
        lines.append(f"  {thread.name} ({thread.samples} samples): {shares}")
        top = ", ".join(f"{leaf} {count / thread.samples:.0%}"
                        for leaf, count in thread.leaves.most_common(4))
        lines.append(f"    top frames: {top}")
    verdict = launch_bound(threads)
    main = threads.get(MAIN_THREAD)
    if verdict is None or main is None:
        lines.append("  verdict: no main thread sampled")
    else:
        share = main.share("forward pass")
        lines.append(f"  verdict: {'launch-bound' if verdict else 'not launch-bound'} (the "
                     f"main thread spends {share:.0%} of its time in an eager forward pass's "
                     f"Python, {main.share('graph replay'):.0%} replaying graphs, "
                     f"{main.share(WAITING):.0%} waiting)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", type=Path, nargs="+", help="py-spy raw files")
    args = parser.parse_args(argv)
    for path in args.profiles:
        try:
            text = path.read_text()
        except OSError as error:
            print(f"{path}: {error}")
            continue
        print(summarise(parse_raw(text), title=f"profile {path.name}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
