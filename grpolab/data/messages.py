"""Chat messages: the one rule for which roles a message may have, shared by training data
(data/loading.py, data/supervised.py) and the OpenAI-compatible server (serve/requests.py), so a row the
trainer accepts is a request the server accepts, and the other way round.

The roles are OpenAI's chat roles: system, developer (OpenAI's newer name for system, rendered as
system: chat templates do not know it), user, assistant and tool.
"""

from __future__ import annotations

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}   # what a role is rendered as


def role_problem(role: object) -> str | None:
    """Why `role` is not a chat role (a phrase for an error message), or None when it is one."""
    if role in CHAT_ROLES:
        return None
    return f"role must be one of {', '.join(CHAT_ROLES)}, got {role!r}"


def canonical_role(role: str) -> str:
    """The role a message is rendered with (developer -> system); `role` must pass `role_problem`."""
    return ROLE_ALIASES.get(role, role)
