"""Where a rank's training thread is, sampled from the publisher thread.

When a job hangs, every rank stops stepping, and the question is which rank
the others wait for. The ranks that wait are inside a collective (or inside
``backward``, where DDP, ZeRO and Gemini all-reduce gradients and wait for
them); the rank they wait for is elsewhere: in its own compute, in its data
loader, or not running Python at all. So the publisher, about once a second,
looks at the training thread's current Python stack (``sys._current_frames``,
a few microseconds, no signal, nothing on the training thread) and classifies
it by the innermost frame that belongs to a known part of torch:

========================  ==============  ====================================
frame in                  activity        what the rank is doing
========================  ==============  ====================================
``torch/distributed/``    ``collective``  a c10d call (all_reduce, barrier, …)
``torch.autograd`` entry   ``backward``    backward, gradient all-reduce waits
``torch/utils/data/``     ``data``        the data loader
``torch/serialization``   ``checkpoint``  torch.save / torch.load
``safetensors/``          ``checkpoint``  safetensors' save_file / load_file
torch.compile's compiler  ``compile``     a compile or recompile: dynamo's
                                          ``convert_frame.py``, inductor's
                                          ``compile_fx.py`` (a backward compiled
                                          at its first call)
a network client          ``network``     an upload or download: ``socket``,
                                          ``ssl``, ``http.client``, requests,
                                          urllib3, httpx, botocore,
                                          s3transfer, huggingface_hub, …
``subprocess.py``         ``subprocess``  waiting for a child process: an
                                          ``aws s3 cp`` or ``rclone`` of the
                                          script's, run with ``subprocess``
anything else             ``compute``     the model, the optimizer, user code
========================  ==============  ====================================

``network`` and ``subprocess`` count only where no part of torch above is further out
on the stack (and ``network`` before ``subprocess``): a
``torch.save`` into an object store's file (s3fs) is ``checkpoint``, a data loader
that reads from one is ``data``; what is left is the script's own transfer (rank 0
pushing a checkpoint to S3 or the Hub), which training/unannounced.py takes for part
of a save.

The frame named is the script's own innermost one, then the library frame the thread
is in when that is elsewhere: ``train.py:88 in upload (client.py:1009 in send)``. The
script's line is what on-call opens; the library's says what it waits in. Code of the
standard library and of installed packages is library code (a training package
installed into site-packages counts as library, and its caller in the script is
named).

Whether a thread in ``data`` is at its data loader's start (an epoch's boundary) or
waits for a later batch is a second look, :func:`data_loader_starting`, taken only for
a rank that has gone a while without a step (training/unannounced.py).

A thread blocked in C with the GIL held cannot be sampled: the publisher does
not run, the snapshot ages, and the node agent reports the rank as not
responding, which is the answer in that case.
"""

from __future__ import annotations

import os
import re
import site
import sys
import sysconfig
from types import FrameType
from typing import Final

from colossalai_exporter.rankstate.schema import Activity

_CATEGORIES: Final = (
    ("/torch/distributed/", "collective"),
    # backward's entry points only: torch/autograd/function.py also runs custom
    # Functions' forward, which is compute.
    ("/torch/autograd/__init__.py", "backward"),
    ("/torch/autograd/graph.py", "backward"),
    ("/torch/utils/data/", "data"),
    ("/torch/serialization.py", "checkpoint"),
    # ColossalAI's checkpoint IO with use_safetensors=True; Hugging Face's save_pretrained
    ("/safetensors/", "checkpoint"),
    # Compiling, not running compiled code: a compiled call runs through eval_frame.py,
    # runtime_wrappers.py and output_code.py, and neither of these is on its stack
    # (sampled on torch 2.13 through a compile, a recompile and 600 compiled steps).
    ("/torch/_dynamo/convert_frame.py", "compile"),
    ("/torch/_inductor/compile_fx.py", "compile"),
)
# Network clients, the standard library's and the common uploaders' (module docstring),
# one pattern: a frame of a stack that classifies as compute is tested against all of
# them, and sixteen substring tests a frame doubled the sample's p99 (bench/RESULTS.md).
_NETWORK: Final = re.compile("|".join(re.escape(marker) for marker in (
    "/socket.py", "/ssl.py", "/http/client.py", "/urllib/request.py", "/urllib3/",
    "/requests/", "/httpx/", "/httpcore/", "/botocore/", "/s3transfer/", "/boto3/",
    "/s3fs/", "/gcsfs/", "/google/cloud/storage/", "/azure/storage/", "/huggingface_hub/")))
# The monitor's own frames (monitor.step()'s block) say nothing about the rank, nor do
# contextlib's around them: a phase change publishes from the training thread, inside
# `with monitor.checkpoint():`, and a save that froze right after (torch.save holding
# the GIL) paged "in compute at contextlib.py in __enter__", its last snapshot's frame.
_SUBPROCESS: Final = f"{os.sep}subprocess.py"
_OWN: Final = f"{os.sep}colossalai_exporter{os.sep}training{os.sep}"
_CONTEXTLIB: Final = f"{os.sep}contextlib.py"
# The standard library's and installed packages' directories: the frames that are not
# the script's own (module docstring).
# Both as given and resolved: a virtual environment reached through a symbolic link
# names its frames by the link.
_LIBRARY: Final = tuple(sorted({
    os.path.join(form, "")
    for path in (*(sysconfig.get_paths().get(key) for key in
                   ("stdlib", "platstdlib", "purelib", "platlib")),
                 *site.getsitepackages(), site.getusersitepackages())
    if path
    for form in (path, os.path.realpath(path))}))
_NOT_SCRIPT: Final = ("<", *_LIBRARY)  # "<frozen …>", "<string>": not a file of the script
# c10d wraps its API in logging decorators; the collective is the wrapped name.
_WRAPPERS: Final = frozenset({"wrapper", "_fn", "inner"})
_DATA_LOADER: Final = "/torch/utils/data/dataloader.py"
# DataLoader's functions that end one iterator or build the next (data_loader_starting).
_STARTING: Final = frozenset({"__iter__", "_get_iterator", "__init__", "_reset",
                              "_shutdown_workers"})


def sample(thread_id: int | None) -> Activity | None:
    """Where the thread ``thread_id`` is now; None when it is not running Python."""
    if thread_id is None:
        return None
    frame = sys._current_frames().get(thread_id)
    top = script = kind = collective = ""
    network = spawned = False
    while frame is not None and not (kind and script):
        filename = frame.f_code.co_filename
        if _OWN in filename or filename.endswith(_CONTEXTLIB):
            frame = frame.f_back
            continue
        if not top:
            top = _named(frame)
        if not script and not filename.startswith(_NOT_SCRIPT):
            script = _named(frame)
        if not kind:
            path = filename.replace(os.sep, "/")
            for marker, category in _CATEGORIES:
                if marker in path:
                    kind = category
                    collective = _collective_name(frame) if kind == "collective" else ""
                    break
            else:
                network = network or _NETWORK.search(path) is not None
                spawned = spawned or filename.endswith(_SUBPROCESS)
        frame = frame.f_back
    if not top:
        return None
    kind = kind or ("network" if network else "subprocess" if spawned else "compute")
    named = top if script in ("", top) else f"{script} ({top})"
    return Activity(kind=kind, frame=named, collective=collective)


def data_loader_starting(thread_id: int | None) -> bool:
    """Whether the thread ``thread_id`` is at a data loader iterator's start: the last
    one's workers stopped, the next one built (worker processes started; with "spawn",
    the dataset pickled to each; the sampler's indices drawn, a permutation of the
    whole dataset for DistributedSampler; persistent workers told to start again), or
    its first batch awaited (each worker's ``worker_init_fn`` and its dataset's first
    items: shards opened, an index read). What an epoch's boundary costs, more than a
    batch, with nothing wrong; a wait for a later batch is the data loader's ordinary
    work, and one that never ends, a hang.

    The first batch is told from a later one by the iterator's count of batches given,
    read from its ``__next__`` frame's locals: under the GIL, while that frame waits.
    Before Python 3.13 reading ``f_locals`` copies the frame's fast locals into its
    locals dict, which the frame itself never reads; a debugger's trace function, the
    one thing that writes that dict back, copies it afresh before it runs. Called only
    for a rank idle past the threshold (training/unannounced.py), not every sample.
    """
    if thread_id is None:
        return False
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.replace(os.sep, "/").endswith(_DATA_LOADER):
            if code.co_name in _STARTING:
                return True
            if code.co_name == "__next__":
                iterator = frame.f_locals.get("self")
                return getattr(iterator, "_num_yielded", None) == 0
        frame = frame.f_back
    return False


def _named(frame: FrameType) -> str:
    """``train.py:88 in step``."""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in " \
           f"{frame.f_code.co_name}"


def _collective_name(frame: object) -> str:
    """The outermost torch.distributed function on the stack from ``frame`` outwards:
    the API call the user's code (or a framework's) made."""
    name = ""
    current = frame
    while current is not None:
        code = current.f_code  # type: ignore[attr-defined]
        if "/torch/distributed/" not in code.co_filename.replace(os.sep, "/"):
            break
        if code.co_name not in _WRAPPERS and not code.co_name.startswith("_"):
            name = code.co_name
        current = current.f_back  # type: ignore[attr-defined]
    return name
