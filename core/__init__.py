"""The ground floor: the wire contract (`core.schemas`) and the one settings object
(`core.settings`). It imports no other package of the project."""
