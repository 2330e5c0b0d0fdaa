"""Text-to-SQL (b-mc2/sql-create-context): ``context``, ``question``, ``answer``."""
from sfttool.registry import MAP_FUNC
from sfttool.utils.templates import SYSTEM_TEMPLATE

from ._fields import text_field


@MAP_FUNC.register_module()
def sql_map_fn(example: dict) -> dict:
    """CREATE TABLE context and question on two lines, with the ``sql`` system prompt.

    >>> sql_map_fn({'context': 'CREATE TABLE t (a INT)', 'question': 'Count rows',
    ...             'answer': 'SELECT COUNT(*) FROM t'})['conversation'][0]['input']
    'CREATE TABLE t (a INT)\\nCount rows'
    """
    context = text_field(example, "context", "sql_map_fn")
    question = text_field(example, "question", "sql_map_fn")
    return {"conversation": [{
        "system": SYSTEM_TEMPLATE.sql,
        "input": f"{context}\n{question}",
        "output": text_field(example, "answer", "sql_map_fn"),
    }]}
