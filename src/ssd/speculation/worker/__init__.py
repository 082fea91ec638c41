"""The SSD draft worker (docs/ARCHITECTURE.md 4, data-parallel drafts 4.2).

- messages.py   typed messages both sides use (configuration, sequences, rounds, replies)
- transport.py  one link = its own two-rank gloo process group
- client.py     the engine's side: start or join a worker, send it its configuration
- proposer.py   the speculative step's proposer backed by the worker(s): fan-out, merge, fail-over
- assign.py     which worker drafts for which sequence (least loaded live worker), pure
- placement.py  where workers run: default and explicit local cores, remote addresses
- serve.py      the worker process (`python -m ssd.speculation.worker`, `ssd draft-worker`)
- worker.py     the worker's round loop: answer, then pre-draft
- drafting.py   batched chain drafting and catch-up
- cache.py      the speculation cache (chains by sequence, round and outcome) and candidate outcomes
- policy.py     pre-draft budget and backup choice, pure, from measured timings
"""
