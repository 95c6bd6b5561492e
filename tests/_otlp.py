"""A minimal OTLP/HTTP receiver on 127.0.0.1 for tests: `POST /v1/traces` (and `/v1/metrics`) bodies decoded with
`opentelemetry-proto` (`ExportTraceServiceRequest`), as a collector would receive them from a process's
`OTLPSpanExporter`. Runs in a thread of the test process; `with OtlpReceiver() as receiver: receiver.endpoint`.
"""

from __future__ import annotations

import gzip
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse


def _value(value: Any) -> Any:
    kind = value.WhichOneof('value')
    return getattr(value, kind) if kind else None


class OtlpReceiver:
    """Collects every span (as a dict: name, trace_id, span_id, parent hex strings, attributes, resource) and the
    names of the metrics received."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.metrics: list[str] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
                encoding = self.headers.get('Content-Encoding')
                if encoding == 'gzip':
                    body = gzip.decompress(body)
                elif encoding == 'deflate':
                    body = zlib.decompress(body)
                if self.path == '/v1/traces':
                    receiver._traces(body)
                    reply = ExportTraceServiceResponse().SerializeToString()
                elif self.path == '/v1/metrics':
                    receiver._metrics(body)
                    reply = ExportMetricsServiceResponse().SerializeToString()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header('Content-Type', 'application/x-protobuf')
                self.send_header('Content-Length', str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f'http://127.0.0.1:{self.server.server_address[1]}'

    def _traces(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    with self.lock:
                        self.spans.append({
                            'name': span.name, 'trace_id': span.trace_id.hex(), 'span_id': span.span_id.hex(),
                            'parent': span.parent_span_id.hex() or None, 'resource': resource,
                            'attributes': {a.key: _value(a.value) for a in span.attributes},
                        })

    def _metrics(self, body: bytes) -> None:
        request = ExportMetricsServiceRequest.FromString(body)
        with self.lock:
            self.metrics += [m.name for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
