"""What hubguard's webhook sends, read by the receivers' own libraries.

Usage: python_webhook_conventions.py REQUESTS_JSON SECRET [SECRET ...]

REQUESTS_JSON holds the requests hubguard made, as the receiver recorded them:
[{"headers": {"name": "value", ...}, "body_b64": "..."}, ...]. For each one this prints a
JSON line: the CloudEvent the official CloudEvents SDK (cloudevents 2.x,
`cloudevents.core.bindings.http.from_http_event`) parses from it — attributes, extensions
and data — or its error, and, per secret, whether the Standard Webhooks reference library
(`standardwebhooks`) verifies the signature. Ends with PYTHON WEBHOOK CONVENTIONS OK.
"""

import base64
import datetime
import hashlib
import hmac
import json
import sys

from cloudevents.core.bindings.http import HTTPMessage, from_http_event
from standardwebhooks.webhooks import Webhook


def jsonable(v):
    if isinstance(v, datetime.datetime):
        return v.isoformat()
    if isinstance(v, bytes):
        return {"bytes_b64": base64.b64encode(v).decode()}
    return v


def main():
    requests = json.load(open(sys.argv[1]))
    secrets = sys.argv[2:]
    for i, r in enumerate(requests):
        headers = r["headers"]
        body = base64.b64decode(r["body_b64"])
        out = {"index": i}
        has_ce = any(k.lower().startswith("ce-") for k in headers) or headers.get(
            "content-type", ""
        ).startswith("application/cloudevents+json")
        if has_ce:
            try:
                event = from_http_event(HTTPMessage(headers=headers, body=body))
                out["cloudevent"] = {
                    k: jsonable(v) for k, v in event.get_attributes().items()
                }
                out["data"] = jsonable(event.get_data())
            except Exception as e:  # reported, asserted on by the Rust test
                out["cloudevent_error"] = repr(e)
        verified = []
        for s in secrets:
            try:
                Webhook(s).verify(body, headers, json_parse=False)
                verified.append(True)
            except Exception as e:
                verified.append(repr(e))
        out["verified"] = verified
        # The reference library decodes the body as UTF-8 (it cannot check a binary body):
        # check those by the specification's recipe, HMAC-SHA256 over id.timestamp.body.
        raw = []
        signed = (
            headers["webhook-id"].encode()
            + b"."
            + headers["webhook-timestamp"].encode()
            + b"."
            + body
        )
        sent = [s.split(",", 1)[1] for s in headers["webhook-signature"].split(" ")]
        for s in secrets:
            key = base64.b64decode(s[len("whsec_"):] + "==")
            mac = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
            raw.append(any(hmac.compare_digest(mac, x) for x in sent))
        out["verified_raw"] = raw
        print(json.dumps(out))
    print("PYTHON WEBHOOK CONVENTIONS OK")


if __name__ == "__main__":
    main()
