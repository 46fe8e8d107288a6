"""Python's cycle collector in a long-running server process: what it scans, and how often.

CPython's collector walks every container object of a generation when that generation is collected. A gateway
or an engine holds tens to hundreds of thousands of objects that live as long as the process (imported modules,
the tokenizer, the model's modules, the routes) and a steady stream of short-lived ones (each request's). Left
at its defaults, the collector runs a young pass every 700 net allocations, which promotes the objects of the
requests in flight at that moment, and then now and again a full pass over the whole heap: 70,000 objects in a
gateway serving a chat model, a pause of tens of milliseconds in which no stream is written.

``settle()`` is called once a process has built everything it keeps (a gateway when it has started serving, an
engine when its model is loaded and warm, a zygote before it forks): one collection, then ``gc.freeze()`` moves
what survived out of every generation for good (as vLLM's engine and Instagram's fork servers do: the Python
documentation recommends freezing before a fork, so that a collection in the child never writes to the pages it
shares with its parent), and the young generation's threshold goes up, so that the objects of a request in
flight are scanned and promoted less often. Nothing is lost: an object that the frozen heap refers to is only
freed when that reference goes, as before, and the serving code leaves no reference cycles to collect on its hot
paths (a request's objects are freed by reference counting the moment it ends).
"""

from __future__ import annotations

import gc

# Net container allocations between two young-generation passes (CPython's default: 700). A request allocates
# about a hundred; 10,000 lets a gateway serve a hundred requests per pass rather than seven, and bounds the
# garbage a cycle somewhere (a failed request's traceback) can hold between passes to a few megabytes.
YOUNG_THRESHOLD = 10_000


def settle() -> None:
    """Collect once, freeze what survives and raise the young generation's threshold (the older ones keep theirs)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
