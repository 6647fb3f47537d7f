"""What differs between the versions the data layer runs on (Spark 3.5 to 4.x; pandas 1.5 and 2.x; pyarrow 14 to
26; numpy 1.23 and 2.x), in one place, each function saying which versions take which branch.

- ``analyzed_plan(jvm, jdf)``: the analyzed plan ``fingerprint.plan_key`` describes, with the no-op operators
  Spark 3.5's analyzer keeps taken out.
"""

from __future__ import annotations

from typing import Any


def analyzed_plan(jvm: Any, jdf: Any) -> Any:
    """The analyzed logical plan of a classic DataFrame (``jdf``: its Java side), no-op operators removed.

    Spark 3.5's analyzer keeps a ``Project`` that selects every column of its child unchanged (``df.select("*")``,
    a pipeline stage that passes columns through), so the same content would key differently from the plan without
    it; Spark 4.x's plan has none there. Catalyst's own ``RemoveNoopOperators`` rule (Spark 2.4 on, same name in
    3.5 and 4.x) takes them out on every version; it changes no plan where there is nothing to remove, so keys of
    4.x plans stay as they were.
    """
    plan = jdf.queryExecution().analyzed()
    return jvm.org.apache.spark.sql.catalyst.optimizer.RemoveNoopOperators.apply(plan)
