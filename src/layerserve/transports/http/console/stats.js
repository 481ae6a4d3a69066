// Rates and quantiles from the overview's cumulative counters and histograms, as Prometheus takes them:
// the difference between two snapshots, over the time between them.

export function difference(current, previous) {
  return Math.max(0, current - (previous ?? 0));
}

// The histogram of what happened between two cumulative ones ({buckets: [[le, cumulative]], count, sum}).
export function histogramBetween(current, previous) {
  const before = new Map((previous?.buckets ?? []).map(([le, count]) => [le, count]));
  return {
    buckets: current.buckets.map(([le, count]) => [le, Math.max(0, count - (before.get(le) ?? 0))]),
    count: difference(current.count, previous?.count),
    sum: difference(current.sum, previous?.sum),
  };
}

// The q-quantile of a histogram, interpolated linearly within its bucket (Prometheus' histogram_quantile);
// null when it is empty.
export function quantile(q, histogram) {
  if (!histogram || histogram.count <= 0) return null;
  const rank = q * histogram.count;
  let lower = 0;
  let below = 0;
  for (const [le, cumulative] of histogram.buckets) {
    if (cumulative >= rank) {
      const inBucket = cumulative - below;
      return inBucket > 0 ? lower + ((le - lower) * (rank - below)) / inBucket : le;
    }
    lower = le;
    below = cumulative;
  }
  return lower; // above the highest finite bucket: its bound, as Prometheus answers
}

export function mean(histogram) {
  return histogram && histogram.count > 0 ? histogram.sum / histogram.count : null;
}

// Every model's histograms summed (the "all models" view).
export function sumHistograms(histograms) {
  const buckets = new Map();
  let count = 0;
  let sum = 0;
  for (const histogram of histograms) {
    for (const [le, value] of histogram.buckets) buckets.set(le, (buckets.get(le) ?? 0) + value);
    count += histogram.count;
    sum += histogram.sum;
  }
  return { buckets: [...buckets.entries()].sort((a, b) => a[0] - b[0]), count, sum };
}
