"""Failure notifications: POST to the operator's webhook whenever an eyas flow run fails or crashes.

    PREFECT_API_URL=http://prefect-host:4200/api python deployments/notifications.py https://hooks.example/eyas

Creates (or replaces) a custom-webhook block `eyas-failure-webhook` holding the URL, and the
automation `eyas-failure-notification`: on `prefect.flow-run.Failed` / `prefect.flow-run.Crashed`
of any eyas flow (`eagle3-pipeline`, `eyas-*`) the Prefect server POSTs JSON
`{"subject": "eyas: flow run NAME Failed", "body": "NAME ended Failed: REASON", "source": BLOCK}`:
the run and the reason (the state message: a bad config's field, the failed task's error). A run whose
subflow failed posts twice: the subflow, then its parent. The server sends it (its automation
services must run: the default), so the URL must be reachable from the Prefect server.
"""

from __future__ import annotations

import argparse

from prefect.automations import Automation
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.events.actions import SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture

from automations import replace_automation  # deployments/automations.py: these run as scripts from here

BLOCK = "eyas-failure-webhook"
AUTOMATION = "eyas-failure-notification"
SUBJECT = "eyas: flow run {{ flow_run.name }} {{ flow_run.state.name }}"
BODY = "{{ flow_run.name }} ended {{ flow_run.state.name }}: {{ flow_run.state.message }}"


def failure_notification(url: str, flows: tuple[str, ...] = ("eagle3-pipeline", "eyas-*")) -> Automation:
    """The webhook block for `url` and the automation that posts to it; re-running replaces both."""
    block = CustomWebhookNotificationBlock(
        name=BLOCK, url=url, method="POST",
        json_data={"subject": "{{subject}}", "body": "{{body}}", "source": "{{name}}"})
    block_id = block.save(BLOCK, overwrite=True)
    replace_automation(AUTOMATION)
    return Automation(
        name=AUTOMATION,
        description=f"POST to the {BLOCK} webhook when an eyas flow run fails or crashes.",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": list(flows)},
            posture=Posture.Reactive, threshold=1),
        actions=[SendNotification(block_document_id=block_id, subject=SUBJECT, body=BODY)],
    ).create()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url", help="the webhook URL the Prefect server POSTs to")
    print(failure_notification(p.parse_args().url).id)
