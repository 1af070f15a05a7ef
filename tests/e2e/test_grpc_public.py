"""The public gRPC API on the real model, used as a generic client would: everything is discovered by
server reflection and built from the reflected descriptors (no generated public_pb2 here)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.proto_gen.kvrelay.v1 import worker_pb2 as worker_pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.e2e.conftest import TOKEN, RunningStack, wait_http_ready
from tests.stack_helpers import Proc, free_port, stack_env, wait_serving

pytestmark = pytest.mark.model

FRANCE = "What is the capital of France?"
INFERENCE = "kvrelay.v1.Inference"


@dataclass
class GenericClient:
    """A channel plus the service as reflection describes it."""

    channel: grpc.Channel
    database: ProtoReflectionDescriptorDatabase
    service: ServiceDescriptor

    def classes(self, method: str) -> tuple[type[Any], type[Any]]:
        descriptor = self.service.methods_by_name[method]
        return (
            message_factory.GetMessageClass(descriptor.input_type),
            message_factory.GetMessageClass(descriptor.output_type),
        )

    def stream(self, method: str, request: Any, timeout: float = 120.0) -> grpc.Future:
        request_cls, response_cls = self.classes(method)
        call = self.channel.unary_stream(
            f"/{self.service.full_name}/{method}",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        return call(request, timeout=timeout)


@pytest.fixture(scope="module")
def grpc_address(
    stack: RunningStack, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A second codec with --grpc-port, in front of the stack's router."""
    http_port, grpc_port = free_port(), free_port()
    args = ["codec", "--model", str(model_dir), "--router", stack.router_address, "--port", str(http_port)]
    env = stack_env(TOKEN, KVRELAY_MODEL__DTYPE="float32")
    proc = Proc([*args, "--grpc-port", str(grpc_port)], env, tmp_path_factory.mktemp("grpc") / "codec.log")
    address = f"127.0.0.1:{grpc_port}"
    try:
        wait_http_ready(f"http://127.0.0.1:{http_port}", proc)
        wait_serving(address, proc)
        yield address
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(grpc_address: str) -> Iterator[GenericClient]:
    with grpc.insecure_channel(grpc_address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        pool = DescriptorPool(database)
        yield GenericClient(channel, database, pool.FindServiceByName(INFERENCE))


def chat_request(client: GenericClient, content: str, **sampling: Any) -> Any:
    request_cls, _ = client.classes("Chat")
    request = request_cls()
    message = request.messages.add()
    message.role, message.content = "user", content
    for name, value in sampling.items():
        setattr(request.sampling, name, value)
    return request


def joined(responses: list[Any]) -> str:
    return "".join(response.text for response in responses if response.index == 0)


def stop_reason_number(client: GenericClient) -> int:
    _, response_cls = client.classes("Chat")
    reason = response_cls.DESCRIPTOR.fields_by_name["finish"].message_type.enum_types_by_name["Reason"]
    return int(reason.values_by_name["STOP"].number)


def test_reflection_lists_the_services(client: GenericClient) -> None:
    services = set(client.database.get_services())
    assert {INFERENCE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    assert {"Chat", "Generate"} <= set(client.service.methods_by_name)


def test_health_is_serving(grpc_address: str) -> None:
    with grpc.insecure_channel(grpc_address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", INFERENCE):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_greedy_chat_answers_paris_and_equals_http(client: GenericClient, stack: RunningStack) -> None:
    responses = list(client.stream("Chat", chat_request(client, FRANCE, temperature=0.0, max_tokens=20)))
    text = joined(responses)
    assert "Paris" in text
    last = responses[-1]
    assert last.finish.reason == stop_reason_number(client)
    body = {"messages": [{"role": "user", "content": FRANCE}], "temperature": 0, "max_tokens": 20}
    model = httpx.get(f"{stack.base_url}/v1/models").json()["data"][0]["id"]
    http = httpx.post(f"{stack.base_url}/v1/chat/completions", json={**body, "model": model}, timeout=120)
    assert http.status_code == 200, http.text
    assert text == http.json()["choices"][0]["message"]["content"]
    usage = http.json()["usage"]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


def test_generate_equals_http_completions(client: GenericClient, stack: RunningStack) -> None:
    request_cls, _ = client.classes("Generate")
    request = request_cls(prompt="The capital of France is")
    request.sampling.temperature, request.sampling.max_tokens = 0.0, 6
    text = joined(list(client.stream("Generate", request)))
    model = httpx.get(f"{stack.base_url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 6}
    http = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=120)
    assert text == http.json()["choices"][0]["text"]


def test_bad_request_is_invalid_argument(client: GenericClient) -> None:
    for request in (chat_request(client, FRANCE, temperature=7.0), client.classes("Chat")[0]()):
        with pytest.raises(grpc.RpcError) as caught:
            list(client.stream("Chat", request))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()


def worker_running(stack: RunningStack) -> int:
    with grpc.insecure_channel(stack.worker_address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        load = stub.Load(worker_pb.LoadRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),))
        return int(load.running)


def test_cancel_aborts_the_request_on_the_worker(client: GenericClient, stack: RunningStack) -> None:
    request = chat_request(client, "Write a long story about a dragon.", max_tokens=400, ignore_eos=True)
    call = client.stream("Chat", request)
    assert next(call).index == 0
    assert worker_running(stack) == 1
    call.cancel()
    deadline = time.monotonic() + 10
    while worker_running(stack) != 0:
        assert time.monotonic() < deadline, "the worker still runs the cancelled request"
        time.sleep(0.05)


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def weather_request(client: GenericClient, mode: str) -> Any:
    request = chat_request(client, "What is the weather in Paris?", max_tokens=80)
    tool = request.tools.add()
    tool.name, tool.parameters_json, tool.strict = "get_weather", json.dumps(WEATHER_SCHEMA), True
    mode_enum = request.tool_choice.DESCRIPTOR.enum_types_by_name["Mode"]
    request.tool_choice.mode = mode_enum.values_by_name[mode].number
    request.tool_choice.name = "get_weather" if mode == "NAMED" else ""
    request.tool_choice.disable_parallel = True
    return request


def test_a_forced_tool_call_streams_as_call_pieces_and_round_trips(client: GenericClient) -> None:
    responses = list(client.stream("Chat", weather_request(client, "NAMED")))
    pieces = [piece for response in responses for piece in response.tool_calls]
    assert pieces and pieces[0].call_index == 0 and pieces[0].name == "get_weather"
    assert pieces[0].id.startswith("call_") and all(not p.id for p in pieces[1:])
    arguments = json.loads("".join(piece.arguments for piece in pieces))
    jsonschema.validate(arguments, WEATHER_SCHEMA)
    reason_enum = responses[-1].finish.DESCRIPTOR.enum_types_by_name["Reason"]
    assert responses[-1].finish.reason == reason_enum.values_by_name["TOOL_CALLS"].number
    assert joined(responses) == ""  # a forced call is the whole answer

    follow_up = weather_request(client, "AUTO")
    assistant = follow_up.messages.add()
    assistant.role = "assistant"
    call = assistant.tool_calls.add()
    call.id, call.name, call.arguments_json = pieces[0].id, "get_weather", json.dumps(arguments)
    result = follow_up.messages.add()
    result.role, result.tool_call_id, result.content = "tool", pieces[0].id, "21 degrees, sunny"
    answer = list(client.stream("Chat", follow_up))
    assert answer[-1].usage.completion_tokens > 0 and answer[-1].finish.num_tokens > 0


def test_a_tool_result_for_no_call_is_invalid_argument(client: GenericClient) -> None:
    request = weather_request(client, "AUTO")
    result = request.messages.add()
    result.role, result.tool_call_id, result.content = "tool", "call_unknown", "21 degrees"
    with pytest.raises(grpc.RpcError) as caught:
        list(client.stream("Chat", request))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "call_unknown" in (caught.value.details() or "")
