"""Interop check: the official Python Event Hubs SDK against hubguard's emulator.

Usage: python3 python_eventhubs.py CONNECTION_STRING HUB
Produces single events and batches (by partition id and by partition key), reads hub and
partition properties, consumes everything back from the earliest position with the
consumer client, and checks bodies, order and annotations. Prints "PYTHON INTEROP OK" and
exits 0 on success; any failure raises.
"""
import sys
import threading

from azure.eventhub import EventData, EventHubConsumerClient, EventHubProducerClient

conn, hub = sys.argv[1], sys.argv[2]

producer = EventHubProducerClient.from_connection_string(conn, eventhub_name=hub)
with producer:
    props = producer.get_eventhub_properties()
    assert props["eventhub_name"] == hub, props
    partition_ids = props["partition_ids"]
    assert partition_ids == ["0", "1"], partition_ids

    single = EventData(b"py-single")
    single.properties = {"origin": "python", "n": 7}
    producer.send_event(single, partition_id="0")

    batch = producer.create_batch(partition_id="0")
    for i in range(20):
        batch.add(EventData(f"py-batch-{i}".encode()))
    producer.send_batch(batch)

    keyed = producer.create_batch(partition_key="py-key")
    for i in range(5):
        keyed.add(EventData(f"py-keyed-{i}".encode()))
    producer.send_batch(keyed)

    p0 = producer.get_partition_properties("0")
    assert p0["last_enqueued_sequence_number"] >= 20, p0  # the keyed batch may hash here too
    assert not p0["is_empty"], p0

expected_total = 26
received = {}
done = threading.Event()


def on_event(partition_context, event):
    if event is None:
        return
    received.setdefault(partition_context.partition_id, []).append(event)
    if sum(len(v) for v in received.values()) >= expected_total:
        done.set()


consumer = EventHubConsumerClient.from_connection_string(conn, consumer_group="$Default", eventhub_name=hub)
thread = threading.Thread(
    target=consumer.receive,
    kwargs={"on_event": on_event, "starting_position": "-1", "max_wait_time": 1},
    daemon=True,
)
thread.start()
ok = done.wait(60)
consumer.close()
thread.join(30)
assert ok, {k: len(v) for k, v in received.items()}

p0 = received["0"]
assert [e.body_as_str() for e in p0[:21]] == ["py-single"] + [f"py-batch-{i}" for i in range(20)], [e.body_as_str() for e in p0]
assert [e.sequence_number for e in p0[:21]] == list(range(21))
assert p0[0].properties[b"origin"] == b"python", p0[0].properties
assert p0[0].properties[b"n"] == 7, p0[0].properties
assert all(isinstance(e.offset, str) and e.offset.isdigit() for e in p0), [e.offset for e in p0]
keyed_events = [e for events in received.values() for e in events if e.partition_key in (b"py-key", "py-key")]
assert [e.body_as_str() for e in keyed_events] == [f"py-keyed-{i}" for i in range(5)], keyed_events
print("PYTHON INTEROP OK")
