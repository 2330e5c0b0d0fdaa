"""Turn one support ticket of `data.jsonl` into the standard conversation format.

A raw row:

    {"id": "ticket-102", "product": "Trailhead 2 tent",
     "dialog": [{"speaker": "customer", "text": "How much does it weigh?"},
                {"speaker": "agent", "text": "1.9 kg with the poles and pegs."}]}

becomes:

    {"conversation": [{"system": "You are the support agent for the Trailhead 2 tent.",
                       "input": "How much does it weigh?",
                       "output": "1.9 kg with the poles and pegs."}]}

The config imports it with `with read_base(): from .map_fn import my_map_fn`
and passes `dataset_map_fn=my_map_fn`. Errors name the ticket, so a bad row is
easy to find.
"""


def my_map_fn(example):
    dialog = example["dialog"]
    speakers = [message["speaker"] for message in dialog]
    if len(dialog) % 2 or speakers != ["customer", "agent"] * (len(dialog) // 2):
        raise ValueError(f"{example['id']}: expected customer/agent messages in turn, got {speakers}")
    turns = [{"input": dialog[i]["text"], "output": dialog[i + 1]["text"]} for i in range(0, len(dialog), 2)]
    turns[0]["system"] = f"You are the support agent for the {example['product']}."
    return {"conversation": turns}
