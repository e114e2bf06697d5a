"""Interop check: the official Python BlobCheckpointStore reads what hubguard's checkpoint store
wrote, and writes what hubguard reads back.

Usage: python3 python_checkpointstore.py ACCOUNT_URL CONTAINER NAMESPACE HUB CONSUMER_GROUP
ACCOUNT_URL is path-style (http://127.0.0.1:PORT/devstoreaccount1), optionally with a SAS query.
Prints one JSON line {"checkpoints": [...], "ownerships": [...]} with what the store listed (as
the store returns them), then updates the checkpoint of partition 2 (sequence number 7, offset
"700") and claims partition 1 for owner "python" with the ETag it listed, and prints
"PYTHON CHECKPOINTSTORE OK".
"""
import json
import sys

from azure.eventhub.extensions.checkpointstoreblob import BlobCheckpointStore

account_url, container, namespace, hub, group = sys.argv[1:6]
store = BlobCheckpointStore(account_url, container)

checkpoints = list(store.list_checkpoints(namespace, hub, group))
ownerships = list(store.list_ownership(namespace, hub, group))
print(json.dumps({
    "checkpoints": [
        {"partition_id": c["partition_id"], "sequence_number": c["sequence_number"], "offset": c["offset"]}
        for c in checkpoints
    ],
    "ownerships": [
        {"partition_id": o["partition_id"], "owner_id": o["owner_id"], "has_etag": bool(o["etag"]),
         "last_modified_time": o["last_modified_time"]}
        for o in ownerships
    ],
}, sort_keys=True))

store.update_checkpoint({
    "fully_qualified_namespace": namespace,
    "eventhub_name": hub,
    "consumer_group": group,
    "partition_id": "2",
    "sequence_number": 7,
    "offset": "700",
})
released = [o for o in ownerships if o["partition_id"] == "1"]
assert released, "partition 1's ownership is listed"
claim = dict(released[0])
claim["owner_id"] = "python"
won = list(store.claim_ownership([claim]))
assert len(won) == 1 and won[0]["owner_id"] == "python", won
print("PYTHON CHECKPOINTSTORE OK")
