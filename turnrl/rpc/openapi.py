"""The OpenAPI 3.1 document of a service's HTTP/JSON routes (turnrl.rpc.http_json), made from
its protobuf descriptors: a path per method, and a schema per message in the shape
protobuf's JSON mapping gives it (proto field names; 64-bit integers as strings, bytes as
base64, enums as their names, Duration as `"1.5s"`, Timestamp as RFC 3339, Struct as any
object). The generated descriptors carry no comments: the `.proto` files under `protos/`
document each field."""

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor

NDJSON = "application/x-ndjson"
TIMEOUT_HEADER = "X-Request-Timeout"
STATUS_SCHEMA = "google.rpc.Status"
# Well-known types, which protobuf's JSON mapping writes as other JSON than an object.
WELL_KNOWN_SCHEMAS: dict[str, dict[str, Any]] = {
    "google.protobuf.Struct": {"type": "object"},
    "google.protobuf.Value": {},
    "google.protobuf.ListValue": {"type": "array"},
    "google.protobuf.Duration": {"type": "string", "pattern": r"^-?[0-9]+(\.[0-9]+)?s$"},
    "google.protobuf.Timestamp": {"type": "string", "format": "date-time"},
}
SCALAR_SCHEMAS: dict[int, dict[str, Any]] = {
    FieldDescriptor.CPPTYPE_INT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.CPPTYPE_UINT32: {"type": "integer", "minimum": 0},
    FieldDescriptor.CPPTYPE_INT64: {"type": "string", "format": "int64"},
    FieldDescriptor.CPPTYPE_UINT64: {"type": "string", "format": "uint64"},
    FieldDescriptor.CPPTYPE_DOUBLE: {"type": "number"},
    FieldDescriptor.CPPTYPE_FLOAT: {"type": "number"},
    FieldDescriptor.CPPTYPE_BOOL: {"type": "boolean"},
}


def openapi_document(service: ServiceDescriptor, *, with_token: bool) -> dict[str, Any]:
    """The OpenAPI document of `service`'s routes; `with_token`: they require a bearer token."""
    schemas: dict[str, dict[str, Any]] = {STATUS_SCHEMA: _status_schema()}
    paths = {}
    for method in service.methods:
        request = _message_ref(method.input_type, schemas)
        reply = _message_ref(method.output_type, schemas)
        request_type = NDJSON if method.client_streaming else "application/json"
        if method.server_streaming:
            reply_content = {
                NDJSON: {
                    "schema": {
                        "oneOf": [
                            reply,
                            {
                                "type": "object",
                                "properties": {"error": _ref(STATUS_SCHEMA)},
                                "required": ["error"],
                            },
                        ]
                    }
                }
            }
        else:
            reply_content = {"application/json": {"schema": reply}}
        paths[f"/v1/{service.name}/{method.name}"] = {
            "post": {
                "operationId": f"{service.name}_{method.name}",
                "summary": f"{method.full_name}, as in protos/ (gRPC: /{service.full_name}/"
                f"{method.name})",
                "parameters": [
                    {
                        "name": TIMEOUT_HEADER,
                        "in": "header",
                        "required": False,
                        "description": "The call's time limit in seconds; none without it.",
                        "schema": {"type": "number", "exclusiveMinimum": 0},
                    }
                ],
                "requestBody": {
                    "required": False,
                    "description": "One request message per line."
                    if method.client_streaming
                    else "The request message; an empty body is the empty message.",
                    "content": {request_type: {"schema": request}},
                },
                "responses": {
                    "200": {
                        "description": "One reply per line, each as it is ready; a failure "
                        "after the first ends the stream with an `error` line."
                        if method.server_streaming
                        else "The reply.",
                        "content": reply_content,
                    },
                    "default": {
                        "description": "An error: the gRPC status, at the HTTP status Google "
                        "maps it to.",
                        "content": {"application/json": {"schema": _ref(STATUS_SCHEMA)}},
                    },
                },
            }
        }
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": f"{service.full_name} over HTTP/JSON", "version": "v1"},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if with_token:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    return document


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _message_ref(message: Descriptor, schemas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The schema of `message`: a well-known type's own, else a reference to the components'
    entry, added (with those of the messages it holds) when new."""
    if message.full_name in WELL_KNOWN_SCHEMAS:
        return WELL_KNOWN_SCHEMAS[message.full_name]
    if message.full_name not in schemas:
        properties: dict[str, Any] = {}
        schemas[message.full_name] = {
            "type": "object",
            "properties": properties,
            "additionalProperties": False,
        }
        for field in message.fields:
            properties[field.name] = _field_schema(field, schemas)
    return _ref(message.full_name)


def _field_schema(field: FieldDescriptor, schemas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value = field.message_type.fields_by_name["value"]
        return {"type": "object", "additionalProperties": _value_schema(value, schemas)}
    schema = _value_schema(field, schemas)
    return {"type": "array", "items": schema} if field.is_repeated else schema


def _value_schema(field: FieldDescriptor, schemas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The schema of one value of `field` (an element, when it is repeated)."""
    if field.message_type is not None:
        return _message_ref(field.message_type, schemas)
    if field.enum_type is not None:
        return {"type": "string", "enum": [value.name for value in field.enum_type.values]}
    if field.type == FieldDescriptor.TYPE_BYTES:
        return {"type": "string", "contentEncoding": "base64"}
    if field.cpp_type == FieldDescriptor.CPPTYPE_STRING:
        return {"type": "string"}
    return SCALAR_SCHEMAS[field.cpp_type]


def _status_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "google.rpc.Status in JSON, with the code's name beside its number.",
        "properties": {
            "code": {"type": "integer", "description": "The gRPC status code."},
            "status": {"type": "string", "description": "Its name, e.g. NOT_FOUND."},
            "message": {"type": "string"},
            "details": {"type": "array", "items": {"type": "object"}},
        },
        "required": ["code", "status", "message", "details"],
    }
