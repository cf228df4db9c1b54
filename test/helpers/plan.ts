/** A node of `EXPLAIN (FORMAT JSON)`, and every node of a plan, for tests that check plans. */
export interface PlanNode {
  'Node Type': string;
  'Relation Name'?: string;
  'Index Name'?: string;
  'Index Cond'?: string;
  'Recheck Cond'?: string;
  Plans?: PlanNode[];
}

/** The node and all nodes under it. */
export const planNodes = (p: PlanNode): PlanNode[] => [p, ...(p.Plans ?? []).flatMap(planNodes)];
