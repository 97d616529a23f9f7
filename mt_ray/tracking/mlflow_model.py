"""An exported Hugging Face folder as an MLflow 3 logged model (transformers flavour) of a run.

The steps of MLflow's own `Model.log`, through an explicit client and run id rather than the
global tracking URI and active run: create the logged model in the run's experiment, link it to
the run as an output (the run page lists it under "Logged models"), save the folder with
`mlflow.transformers.save_model` (from the folder's files: the model is not loaded), upload it
and mark it READY, then register a version when asked. A model card is given, so MLflow does not
ask the Hugging Face Hub for one (it would warn that a local path is not a repo id).
"""

from __future__ import annotations

import importlib.metadata
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import LoggedModel

REQUIREMENTS = ("torch", "transformers", "safetensors", "tokenizers", "accelerate")


def log_transformers_model(client: MlflowClient, run_id: str, folder: str | Path, *, name: str = "model",
                           task: str = "text-generation", step: int = 0, register_as: str | None = None) -> str:
    """Log `folder` as run `run_id`'s model `name`; returns `models:/<model id>` (loadable with
    `mlflow.transformers.load_model`). `register_as` also makes it a version of that registered model."""
    import mlflow.transformers
    from huggingface_hub import ModelCard
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    run = client.get_run(run_id)
    logged = client.create_logged_model(run.info.experiment_id, name=name, source_run_id=run_id)
    client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step)])
    card = ModelCard(f"---\nlibrary_name: transformers\npipeline_tag: {task}\ntags: [mt-ray]\n---\n"
                     f"# {run.info.run_name or name}\n\nTrained with mt-ray (MLflow run `{run_id}`).\n")
    requirements = [f"{p}=={importlib.metadata.version(p)}" for p in REQUIREMENTS]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / name
            description = Model(artifact_path=logged.artifact_location, model_uuid=logged.model_id, run_id=run_id,
                                model_id=logged.model_id)
            mlflow.transformers.save_model(str(folder), path=str(local), mlflow_model=description, task=task,
                                           model_card=card, pip_requirements=requirements)
            client.log_model_artifacts(logged.model_id, str(local))
    except BaseException:
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    if register_as:
        register(client, register_as, logged, run_id)
    return f"models:/{logged.model_id}"


def register(client: MlflowClient, name: str, logged: LoggedModel, run_id: str) -> str:
    """A new version of registered model `name` (created if missing); returns `models:/<name>/<version>`.

    The source is the model's artifact location, not `models:/<id>`: MLflow's SQL registry resolves
    the latter through the global tracking URI, which need not be this client's.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
    version = client.create_model_version(name, logged.artifact_location, run_id=run_id, model_id=logged.model_id)
    # What MLflow's register_model adds: the logged model's page links to its registered versions.
    client.set_logged_model_tags(logged.model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(
        [{"name": version.name, "version": version.version}])})
    return f"models:/{name}/{version.version}"
