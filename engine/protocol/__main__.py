"""Print the owner's and the writer's transition tables (markdown)."""

from .owner import render_owner_table
from .writer import render_writer_table

print(render_owner_table())
print()
print(render_writer_table())
