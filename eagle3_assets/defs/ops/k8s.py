"""On Kubernetes, every step runs in its own pod (dagster-k8s `k8s_job_executor`).

Which pods get GPUs is one YAML file, the executor's config (deploy/k8s/executor.yaml,
checked by the tests against dagster-k8s itself): `step_k8s_config` is the CPU-only
default of every step, `per_step_k8s_config` adds GPU requests, node selector and
tolerations for the steps that need the accelerator, keyed by op name. No asset code
carries cluster details, and the same definitions run on one machine when
$EAGLE3_K8S_EXECUTOR is unset.

    EAGLE3_K8S_EXECUTOR=/etc/eagle3/executor.yaml   (in the code-location pod)
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml
from dagster import ExecutorDefinition

from eagle3_assets.errors import Refusal

K8S_EXECUTOR_ENV = "EAGLE3_K8S_EXECUTOR"
DAGSTER_K8S_PIN = "dagster-k8s==0.29.27"


class K8sConfigError(Refusal, ValueError):
    """The executor file cannot be used; the message names the file and the problem."""


def load_executor_config(path: str | Path, known_ops: Collection[str]) -> dict[str, Any]:
    """The k8s_job_executor config in `path` (YAML mapping). A per-step entry must name one of `known_ops`
    (the definitions' assets, checks and ops): a typo would silently leave a GPU step on a CPU pod."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise K8sConfigError(f"{K8S_EXECUTOR_ENV}={path}: cannot read it: {e}") from None
    except yaml.YAMLError as e:
        raise K8sConfigError(f"{K8S_EXECUTOR_ENV}={path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise K8sConfigError(f"{K8S_EXECUTOR_ENV}={path}: expected a mapping of executor settings")
    unknown = sorted(set(data.get("per_step_k8s_config") or {}) - set(known_ops))
    if unknown:
        raise K8sConfigError(f"{K8S_EXECUTOR_ENV}={path}: per_step_k8s_config names unknown ops {unknown}")
    return data


def k8s_executor_from_environment(
    known_ops: Collection[str], environ: Mapping[str, str] | None = None
) -> ExecutorDefinition | None:
    """The configured k8s_job_executor when $EAGLE3_K8S_EXECUTOR names a file; None = Dagster's default."""
    env = os.environ if environ is None else environ
    path = env.get(K8S_EXECUTOR_ENV)
    if not path:
        return None
    config = load_executor_config(path, known_ops)
    try:
        from dagster_k8s import k8s_job_executor
    except ImportError:
        raise K8sConfigError(
            f"{K8S_EXECUTOR_ENV} is set but dagster-k8s is not installed ({DAGSTER_K8S_PIN})"
        ) from None
    return k8s_job_executor.configured(config, name="eagle3_k8s_executor")
