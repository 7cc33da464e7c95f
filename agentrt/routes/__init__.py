"""HTTP routes: thin controllers over the services kept on app.state."""

from agentrt.routes.chains import ChainController
from agentrt.routes.openai import OpenAIController
from agentrt.routes.system import SystemController

__all__ = ["ChainController", "OpenAIController", "SystemController"]
