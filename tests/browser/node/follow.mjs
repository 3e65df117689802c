// Follow one sluicegate run with a WHATWG EventSource (the `eventsource` package), as a browser
// page would: nothing but the URL (its follow token in it). One JSON line per thing that happens
// on stdout: {"open": n}, {"id", "data"} per message, {"error": status}, then {"closed": true}
// once the EventSource gave up reconnecting by itself (sluicegate's 204 at the run's end).
import { EventSource } from "eventsource";

const say = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");
const source = new EventSource(process.argv[2]);
let opens = 0;

source.onopen = () => say({ open: ++opens });
source.onmessage = (event) => say({ id: event.lastEventId, data: event.data });
source.onerror = (event) => {
  say({ error: event.code ?? null, message: event.message ?? "" });
  if (source.readyState === EventSource.CLOSED) {
    say({ closed: true });
    process.exit(0);
  }
};
