"""Real training tasks on data that ships offline, registered by name.

import thinwire.tasks
thinwire.tasks.tasks()                              # names and one-line summaries
task = thinwire.tasks.task("fashion", batch_size=32, width=32)
"""

from thinwire.tasks import digits_task, fashion, gpt, packages, text  # noqa: F401  (registers them)
from thinwire.tasks.base import Task, seeded_init, step_generator
from thinwire.tasks.digits_task import DigitsTask
from thinwire.tasks.fashion import FashionTask
from thinwire.tasks.gpt import GPTTask
from thinwire.tasks.packages import PackagesTask
from thinwire.tasks.registry import register_task, task, task_class, task_options, tasks
from thinwire.tasks.text import TextTask

__all__ = [
    "DigitsTask",
    "FashionTask",
    "GPTTask",
    "PackagesTask",
    "Task",
    "TextTask",
    "register_task",
    "seeded_init",
    "step_generator",
    "task",
    "task_class",
    "task_options",
    "tasks",
]
