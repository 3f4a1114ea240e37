"""The module `uvicorn api.main:app` serves: the gateway configured from the environment."""

from api.app import create_app

app = create_app()
