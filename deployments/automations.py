"""Example automation: start training when extraction completes.

    PREFECT_API_URL=http://127.0.0.1:4200/api python deployments/automations.py local-tiny \
        [--params '{"overrides": {"training.max_steps": 50}}']

The `extract` flow emits `eyas.extraction.completed` on resource `eyas.run.<config name>`, labelled
`eyas.standalone: "true"` when it ran alone (a deployment run of `eyas-extract/extract`) and
"false" as the pipeline's subflow, whose own train stage follows. This automation answers only the
standalone ones by running the `eyas-train/train` deployment with the given parameters
(default: the deployment's own). Re-running the script replaces the automation of the same name.
"""

from __future__ import annotations

import argparse
import json

from prefect.automations import Automation
from prefect.client.orchestration import get_client
from prefect.events.actions import RunDeployment
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.exceptions import ObjectNotFound


def replace_automation(name: str) -> None:
    """Delete the automation called `name`, if any: re-running a script replaces, never
    duplicates."""
    try:
        Automation.read(name=name).delete()
    except (ValueError, ObjectNotFound):
        pass


def train_after_extraction(
    run_name: str, parameters: dict | None = None, deployment: str = "eyas-train/train"
) -> Automation:
    with get_client(sync_client=True) as client:
        deployment_id = client.read_deployment_by_name(deployment).id
    name = f"train-after-extraction-{run_name}"
    replace_automation(name)
    return Automation(
        name=name,
        description=f"When a standalone extraction of {run_name} completes, run {deployment}.",
        trigger=EventTrigger(
            expect={"eyas.extraction.completed"},
            match={"prefect.resource.id": f"eyas.run.{run_name}", "eyas.standalone": "true"},
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[
            RunDeployment(source="selected", deployment_id=deployment_id, parameters=parameters)
        ],
    ).create()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_name", help="the config's name (eyas.run.<name> is the event's resource)")
    p.add_argument("--params", default=None, help="JSON parameters for the train deployment")
    args = p.parse_args()
    a = train_after_extraction(args.run_name, json.loads(args.params) if args.params else None)
    print(a.id)
