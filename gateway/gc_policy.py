"""The garbage collector's settings for a serving gateway: one place, applied once start-up is done.

CPython's defaults suit a short script: a young collection after every 700 net new container
objects, and a full one that walks every tracked object, the app's own included. In a server the
app, its modules, routes, metrics and adapters are built once and live forever, so walking them
again and again buys nothing and costs the streams a pause each time. Hence (design §11):

- `gc.freeze()` once start-up is over moves everything alive then into the permanent generation,
  which no collection walks;
- a young generation of `GEN0_THRESHOLD` objects instead of 700, so young collections (which a
  busy event loop's futures, tasks and exceptions keep triggering) come about 30x less often, and
  each still walks only the young objects.

The collector stays on: reference cycles made while serving are still found and freed.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 20_000  # young objects before a young collection (CPython's default: 700)


def settle_for_serving() -> None:
    """Call once the app is started (workers, adapters and stores set up): freeze what start-up
    built and size the young generation for a server."""
    gc.collect()  # NOTE: start-up's garbage goes now, so freezing keeps only what is alive
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
