// Numbers for people.

export function bytes(n) {
  if (typeof n !== "number" || !Number.isFinite(n)) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit === 0 ? 0 : value < 10 ? 2 : 1)} ${units[unit]}`;
}

export function count(n) {
  return typeof n === "number" ? n.toLocaleString("en-US") : "";
}

export function rate(perSecond) {
  return `${perSecond.toFixed(perSecond < 10 ? 1 : 0)} tok/s`;
}

export function milliseconds(ms) {
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${Math.round(ms)} ms`;
}
