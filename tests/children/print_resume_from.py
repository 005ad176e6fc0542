"""Print the checkpoint the supervisor chose (RTRAIN_RESUME_FROM) and exit 0."""

import json
import os

print(json.dumps({"resume_from": os.environ.get("RTRAIN_RESUME_FROM")}), flush=True)
