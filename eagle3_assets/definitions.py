"""The Dagster code location: `dagster dev -m eagle3_assets.definitions` or `-w workspace.yaml`."""

from dagster import Definitions

from eagle3_assets.defs.data import assets as data_assets
from eagle3_assets.defs.data import checks as data_checks
from eagle3_assets.project import Project

defs = Definitions(
    assets=[
        data_assets.prompts,
        data_assets.target_model,
        data_assets.responses,
        data_assets.tokenized,
        data_assets.token_freq,
        data_assets.vocab_map,
    ],
    asset_checks=[data_checks.vocab_map_invariant],
    resources={"project": Project.from_environment()},
)
