"""gRPC plumbing for the four services and their clients:

- `server`: one server bootstrap (health, reflection, TLS, bearer-token auth, graceful
  shutdown, metrics endpoint): `start_server`, `serve`, `stop_server`;
- `status`: error-to-status mapping on the server (`StatusMappingInterceptor`, by
  `STATUS_BY_ERROR`) and status-to-error on the caller (`RPC_ERROR_BY_STATUS`);
- `fields`: the request fields whose conversion a bad value breaks (`positive_seconds`,
  `json_value`: INVALID_ARGUMENT rather than INTERNAL);
- `channels`: one channel factory (keepalive, default deadline, token, status-to-error
  mapping), retries for idempotent calls, `wait_until_serving`, `list_services`;
- `credentials`: TLS and mTLS from PEM files, for both sides;
- `http_json` and `openapi`: a service's methods as JSON over HTTP beside its gRPC server
  (`server.http_port` of the tool and reward services), described by an OpenAPI document;
  imported by their own module path (`turnrl.rpc.http_json.serve_http_json`), since they load
  Starlette and uvicorn, which gRPC callers do not need.

Besides the services' `server.py` files, this is the only turnrl package that imports grpc:
service logic raises `turnrl.errors` exceptions and `StatusMappingInterceptor` turns them into
status codes, so no servicer needs a try/except; on the calling side the channels of
`open_channel` raise a failed call as the `errors.RpcError` of its status, so no caller
catches grpc's own error. Callers use the names below as `rpc.NAME`.
"""

from turnrl.rpc.channels import call_idempotent, list_services, open_channel, wait_until_serving
from turnrl.rpc.fields import MAX_DURATION_SECONDS, json_value, positive_seconds
from turnrl.rpc.server import RunningServer, serve, start_server, stop_server
from turnrl.rpc.status import RPC_ERROR_BY_STATUS, STATUS_BY_ERROR

__all__ = [
    "MAX_DURATION_SECONDS",
    "RPC_ERROR_BY_STATUS",
    "STATUS_BY_ERROR",
    "RunningServer",
    "call_idempotent",
    "json_value",
    "list_services",
    "open_channel",
    "positive_seconds",
    "serve",
    "start_server",
    "stop_server",
    "wait_until_serving",
]
