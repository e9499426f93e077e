"""The router: one HTTP front for several loom servers (`loom router --worker-urls ...`).

args.py (RouterArgs), policy.py (round_robin / shortest_queue / cache_aware), tree.py (the
approximate radix tree of the cache-aware policy), workers.py (pool, health checks),
proxy.py (forwarding and retries), app.py (the FastAPI app), launch.py (`run(argv)`).
Light: no torch import (it runs beside the workers, or on a machine of its own).
"""
