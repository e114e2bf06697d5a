"""Interop check: a 1,000,000-byte event through the official Python Event Hubs SDK.

Usage: python3 python_large_event.py CONNECTION_STRING HUB
Sends one 1,000,000-byte event to partition 0 (more than one 65,536-byte frame, the emulator's
max-frame-size, so the producer's delivery arrives in several transfer frames), reads it back
with the consumer client and checks it byte for byte. Then checks that an event over 1 MiB
cannot be sent (the link advertises max-message-size 1,048,576). Prints "PYTHON LARGE OK".
"""
import sys
import threading

from azure.eventhub import EventData, EventHubConsumerClient, EventHubProducerClient

conn, hub = sys.argv[1], sys.argv[2]
body = bytes(i % 251 for i in range(1_000_000))

producer = EventHubProducerClient.from_connection_string(conn, eventhub_name=hub)
with producer:
    producer.send_event(EventData(body), partition_id="0")
    too_big = EventData(b"x" * 1_048_577)
    try:
        producer.send_event(too_big, partition_id="0")
    except Exception as e:  # the SDK refuses it against the advertised limit, or the emulator rejects it
        refused = repr(e)
    else:
        raise AssertionError("an event over 1 MiB was accepted")
    print("over-limit event refused:", refused[:200])

received = []
done = threading.Event()


def on_event(partition_context, event):
    if event is None:
        return
    received.append(event)
    done.set()


consumer = EventHubConsumerClient.from_connection_string(conn, consumer_group="$Default", eventhub_name=hub)
thread = threading.Thread(
    target=consumer.receive,
    kwargs={"on_event": on_event, "starting_position": "-1", "partition_id": "0", "max_wait_time": 1},
    daemon=True,
)
thread.start()
ok = done.wait(60)
consumer.close()
thread.join(30)
assert ok, "the 1 MB event was not received"
got = b"".join(received[0].body)
assert len(got) == len(body), len(got)
assert got == body
assert received[0].sequence_number == 0
print("PYTHON LARGE OK")
