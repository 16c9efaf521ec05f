"""A calculator agent written with LangGraph (a prebuilt ReAct graph over LangChain's
ChatOpenAI): it runs as is against any OpenAI-compatible server, and turnrl trains it
unchanged (config.yaml beside it).

turnrl calls `solve(prompt, base_url, api_key)` once per episode with the base URL of the
episode's gateway session; the graph calls the model, runs the calculator tool node and loops
until the model answers. The answer it returns is scored by the reward service.
"""

from typing import Any

import openai
from langchain_core.tools import StructuredTool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from examples.openai_agent.agent import calculate

# The schema the policy was fine-tuned with (one place in turnrl); an agent of your own has
# its own tools.
from turnrl.calculator_data import CALCULATOR_TOOL

MAX_TURNS = 4
CALCULATOR = StructuredTool.from_function(
    calculate,
    name=CALCULATOR_TOOL["function"]["name"],
    description=CALCULATOR_TOOL["function"]["description"],
    args_schema=CALCULATOR_TOOL["function"]["parameters"],
)


def solve(prompt: dict[str, Any], base_url: str, api_key: str) -> str:
    """Runs the graph on the prompt's conversation; returns the model's final message."""
    name = openai.OpenAI(base_url=base_url, api_key=api_key).models.list().data[0].id
    model = ChatOpenAI(base_url=base_url, api_key=api_key, model=name, max_retries=0)
    graph = create_react_agent(model, [CALCULATOR])
    state = graph.invoke({"messages": prompt["messages"]}, {"recursion_limit": 2 * MAX_TURNS + 1})
    return state["messages"][-1].content
