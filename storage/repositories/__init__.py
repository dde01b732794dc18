"""The store's queries, one module per concept; each repository works through a :class:`storage.database.Database`.

* :mod:`.documents`: documents (their text and pages), lookup by id prefix or name, delete with everything of theirs
* :mod:`.contexts`: prepared contexts (document x model x settings) and their artifacts (one tensor file each)
* :mod:`.method_builds`: which sparse-attention methods are built for a context, with which settings
* :mod:`.model_artifacts`: tensors learned once per model and method (not per document)
* :mod:`.jobs`: ingest jobs, the one record of their state
* :mod:`.chats`: chats about a document and their turns
* :mod:`.evals`: results of ``squeeze eval``, per model
"""

from .chats import Chats
from .contexts import Artifacts, Contexts
from .documents import Documents
from .evals import Evals
from .jobs import Jobs
from .method_builds import MethodBuilds
from .model_artifacts import ModelArtifacts

__all__ = ["Artifacts", "Chats", "Contexts", "Documents", "Evals", "Jobs", "MethodBuilds", "ModelArtifacts"]
