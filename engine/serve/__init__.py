"""The serving layer: what the command line and the app use, above the engine's core.

`service.Engine` (documents in, cached contexts and method indexes on disk, answers out), `jobs.IngestWorker`
(preparation in the background, its progress in the store), `turns.Turns` (a chat turn answered, explained and
recorded), `explain` (what a turn retrieved, from a context's artifacts), `writer` (artifacts saved while an ingest
runs). The core (engine/*.py, engine/methods/) never imports this package.
"""
