"""Built-in tools, by the name a config's `class_name` uses. A user tool is named by import path."""

from tool_svc.tools.base import Tool
from tool_svc.tools.calculator import CalculatorTool
from tool_svc.tools.gsm8k_answer import Gsm8kAnswerTool
from tool_svc.tools.image_zoom import ImageZoomTool
from tool_svc.tools.mcp import McpTool
from tool_svc.tools.python import PythonTool
from tool_svc.tools.sandbox_fusion import SandboxFusionTool
from tool_svc.tools.search import SearchTool

TOOLS: dict[str, type[Tool]] = {
    "calculator": CalculatorTool,
    "gsm8k_answer": Gsm8kAnswerTool,
    "image_zoom": ImageZoomTool,
    "mcp": McpTool,
    "python": PythonTool,
    "sandbox_fusion": SandboxFusionTool,
    "search": SearchTool,
}
