"""A flow run as a subflow of the current flow run, in a background thread.

With a worker, the pivot hands the resumed trainer to a new `train` deployment run. In the embedded
demo there is no worker to hand it to, so the `train` flow runs here, beside the flow that started it,
and still shows as a flow run of its own in the UI."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="andrea-subflow")


def start_subflow(flow: Callable[..., Any], **parameters: Any) -> Future:
    # The copied context carries the calling flow run, which makes the new run its subflow.
    context = contextvars.copy_context()
    return _pool.submit(context.run, flow, **parameters)
