/** Outboxes a test file opens, each closed after its test unless the test closed it (`closeAll` in afterEach). */
import pino, { type Logger } from 'pino';
import { Outbox } from '@leasehold/agent-client';

export function outboxKeeper() {
  const open: Outbox[] = [];
  return {
    async open(dir: string, log?: Logger, options: ConstructorParameters<typeof Outbox>[2] = {}): Promise<Outbox> {
      const o = new Outbox(dir, log ?? pino({ level: 'silent' }), options);
      await o.open();
      open.push(o);
      return o;
    },
    /** Closes `o` within the test (a restart), so it is not closed again after it. */
    async closed(o: Outbox): Promise<void> {
      await o.close();
      open.splice(open.indexOf(o), 1);
    },
    async closeAll(): Promise<void> {
      for (const o of open.splice(0)) await o.close();
    },
  };
}
