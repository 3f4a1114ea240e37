"""Task handlers: what a task asks of the model and how its answer is graded."""

from workers.handlers.base import Grade, Handler, StepResult, TaskValidationError
from workers.handlers.registry import UnknownDataSource, get_handler, known_handlers

__all__ = [
    "Grade",
    "Handler",
    "StepResult",
    "TaskValidationError",
    "UnknownDataSource",
    "get_handler",
    "known_handlers",
]
