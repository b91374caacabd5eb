"""Failure notifications: one POST to the operator's webhook per failed or crashed eyas deployment
run.

    PREFECT_API_URL=http://prefect-host:4200/api python deployments/notifications.py
    https://hooks.example/eyas

Creates (or replaces) a custom-webhook block `eyas-failure-webhook` holding the URL, and the
automation `eyas-failure-notification`: on `prefect.flow-run.Failed` / `prefect.flow-run.Crashed`
of a deployment's run of an eyas flow (`eagle3-pipeline`, `eyas-*`) the Prefect server POSTs JSON
`{"subject": "eyas: flow run NAME Failed", "body": BODY, "source": BLOCK}`, BODY being

    NAME ended Failed: failed at TASK: REASON
    run: http://prefect-host:4200/runs/flow-run/ID
    deployment: FLOW/DEPLOYMENT

the run's final state message (the Failed state flows/common.py:checked_flow returns: the task run
that raised and the reason, or a bad config's field), the run's page in the UI (the server's
PREFECT_UI_URL, by default its API URL's UI) and the deployment. One POST per failed run: its
subflows are not deployment runs (they carry no deployment), so a failure deep in `serve` posts
once, for the pipeline run, not once per level. Runs outside a deployment (`eyas run`, `python -m
eyas_prefect.flows.pipeline`) print their reason on the console instead. The server sends it (its
automation services must run: the default), so the URL must be reachable from the Prefect server.
"""

from __future__ import annotations

import argparse

from automations import (
    replace_automation,  # deployments/automations.py: these run as scripts from here
)
from prefect.automations import Automation
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.events.actions import SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture

BLOCK = "eyas-failure-webhook"
AUTOMATION = "eyas-failure-notification"
SUBJECT = "eyas: flow run {{ flow_run.name }} {{ flow_run.state.name }}"
BODY = (
    "{{ flow_run.name }} ended {{ flow_run.state.name }}: {{ flow_run.state.message }}\n"
    "run: {{ flow_run|ui_url }}\ndeployment: {{ flow.name }}/{{ deployment.name }}"
)


def failure_notification(
    url: str, flows: tuple[str, ...] = ("eagle3-pipeline", "eyas-*")
) -> Automation:
    """The webhook block for `url` and the automation that posts to it; re-running replaces both."""
    block = CustomWebhookNotificationBlock(
        name=BLOCK,
        url=url,
        method="POST",
        json_data={"subject": "{{subject}}", "body": "{{body}}", "source": "{{name}}"},
    )
    block_id = block.save(BLOCK, overwrite=True)
    replace_automation(AUTOMATION)
    return Automation(
        name=AUTOMATION,
        description=f"POST to the {BLOCK} webhook when an eyas deployment run fails or crashes.",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            # a deployment's own run only: a subflow has no deployment, so a failure posts once
            match_related=[
                {"prefect.resource.role": "flow", "prefect.resource.name": list(flows)},
                {"prefect.resource.role": "deployment"},
            ],
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[SendNotification(block_document_id=block_id, subject=SUBJECT, body=BODY)],
    ).create()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url", help="the webhook URL the Prefect server POSTs to")
    print(failure_notification(p.parse_args().url).id)
