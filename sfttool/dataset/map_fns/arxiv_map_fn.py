"""arXiv abstracts -> titles: ``abstract``, ``title``."""
from sfttool.registry import MAP_FUNC
from sfttool.utils.templates import SYSTEM_TEMPLATE

from ._fields import text_field


@MAP_FUNC.register_module()
def arxiv_map_fn(example: dict) -> dict:
    """Generate a paper title from its abstract, with the ``arxiv_gentile`` system prompt.

    >>> arxiv_map_fn({'abstract': 'We study X.', 'title': 'On X'})['conversation'][0]['output']
    'On X'
    """
    return {"conversation": [{
        "system": SYSTEM_TEMPLATE.arxiv_gentile,
        "input": text_field(example, "abstract", "arxiv_map_fn"),
        "output": text_field(example, "title", "arxiv_map_fn"),
    }]}
