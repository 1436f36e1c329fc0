// The API key dialog: opened by api.js on a 401, it saves the key in
// localStorage. Concurrent 401s share one dialog.

import { saveApiKey } from "./storage.js";

let pending = null;

// Resolves to the key the user saved, or "" when they closed the dialog.
export function askForKey(reason) {
  if (pending) return pending;
  const dialog = document.getElementById("key-dialog");
  const form = document.getElementById("key-form");
  const input = dialog.querySelector("[data-testid=key-input]");
  const note = document.getElementById("key-error");
  note.textContent = reason || "";
  note.hidden = !reason;
  input.value = "";
  pending = new Promise((resolve) => {
    const finish = (key) => {
      form.removeEventListener("submit", onSubmit);
      dialog.removeEventListener("cancel", onCancel);
      if (dialog.open) dialog.close();
      pending = null;
      resolve(key);
    };
    const onSubmit = (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (!key) {
        input.focus();
        return;
      }
      saveApiKey(key);
      finish(key);
    };
    const onCancel = () => finish("");
    form.addEventListener("submit", onSubmit);
    dialog.addEventListener("cancel", onCancel);
  });
  dialog.showModal();
  input.focus();
  return pending;
}
