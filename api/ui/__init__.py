"""The web console at `/ui`: batches, fleet, backends and a trajectory viewer, rendered on the
server with Jinja2 and kept live with htmx (shipped under `static/`, no build step)."""
