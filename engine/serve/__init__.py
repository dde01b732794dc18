"""The serving layer: what the command line and the app use, above the engine's core; the app imports it from
this package, never from its modules (tests/test_rooms.py).

`service.Engine` (documents in, cached contexts and method indexes on disk, answers out), `jobs.IngestWorker`
(preparation in the background, its progress in the store), `turns.Turns` (a chat turn answered, explained and
recorded), `explain.ContextInspector` (what a turn retrieved, from a context's artifacts), `preparer.Preparer`
(what a method learns once per model, in the background), `writer` (artifacts saved while an ingest runs),
`evals` (`squeeze eval`'s results as shown), `scheduler` (every user's turns on one model: together, or queued
with their place told). With them, the names of the engine's lower rooms that its users need.
"""

from engine.context.session import Answer, Delta
from engine.context.settings import ContextSettings
from engine.methods import METHODS, REGISTRY, SPARSE_METHODS, build_order, make_method
from engine.methods.hsqueeze import HierarchicalSettings
from engine.methods.squeeze import SqueezeSettings
from engine.model.catalog import DEFAULT_METHOD, DEFAULT_SPARSITY, EMBEDDED_MODEL, MAX_SPARSITY, GenerationOptions
from engine.serve.evals import full_attention_found
from engine.serve.explain import ContextInspector
from engine.serve.jobs import LOADING, STAGES, IngestWorker, JobView, document_id, plain_error
from engine.serve.preparer import Preparer, PrepView
from engine.serve.scheduler import Waiting
from engine.serve.service import Engine, IngestReport, Overrides
from engine.serve.turns import EMPTY_ANSWER, RecordedTurn, Turns

__all__ = [
    "Answer", "ContextInspector", "ContextSettings", "DEFAULT_METHOD", "DEFAULT_SPARSITY", "Delta", "EMBEDDED_MODEL",
    "EMPTY_ANSWER", "Engine", "GenerationOptions", "HierarchicalSettings", "IngestReport", "IngestWorker", "JobView",
    "LOADING", "MAX_SPARSITY", "METHODS", "Overrides", "PrepView", "Preparer", "REGISTRY", "RecordedTurn",
    "SPARSE_METHODS", "STAGES", "SqueezeSettings", "Turns", "Waiting", "build_order", "document_id",
    "full_attention_found", "make_method", "plain_error",
]
